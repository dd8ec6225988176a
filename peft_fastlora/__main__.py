"""``python -m peft_fastlora ...``: the command line of [`peft_fastlora.cli`] (also installed as ``peft-fastlora``)."""

import sys

from .cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
