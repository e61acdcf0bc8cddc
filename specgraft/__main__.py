"""``python -m specgraft`` runs the command line."""

import sys

from specgraft.cli import main

sys.exit(main())
