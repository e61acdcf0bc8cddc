"""``accelerate launch -m specgraft.train RECIPE [key=value ...] [--resume]``: one training process."""

import sys

from specgraft.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
