"""``accelerate launch -m specgraft.distill RECIPE [key=value ...] [--resume]``: one distillation process."""

import sys

from specgraft.cli import main

if __name__ == "__main__":
    sys.exit(main(["distill", *sys.argv[1:]]))
