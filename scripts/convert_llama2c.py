"""Convert a llama2.c checkpoint + tokenizer to a transformers folder (same as `specgraft convert-llama2c`).

Usage: python scripts/convert_llama2c.py stories260K.bin tok512.bin --out stories260K-hf [--overwrite]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the converter; problems a user can fix print ``error: ...`` and return 2."""
    try:
        import specgraft  # noqa: F401
    except ImportError:
        # Run from a source checkout without `pip install`: the package sits beside this scripts/ folder.
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from specgraft.commands.convert_llama2c import add_arguments, run
    from specgraft.errors import SpecgraftError

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except SpecgraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
