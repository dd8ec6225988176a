"""Command line: ``peft-fastlora export-lora SRC DST`` (also ``python -m peft_fastlora export-lora SRC DST``)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

EXPORT_HELP = """\
Write a plain PEFT LoRA copy of a FastLoRA adapter: the same weights (copied byte for byte), an adapter_config.json
with "peft_type": "LORA" and without the FastLoRA-only fields, and a README. Stock PEFT (without peft_fastlora),
vLLM and other LoRA consumers load the copy."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="peft-fastlora", description="peft-fastlora command line tools.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    export = commands.add_parser(
        "export-lora",
        help="write a plain LoRA copy of a FastLoRA adapter (for stock PEFT, vLLM, ...)",
        description=EXPORT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export.add_argument("src", metavar="SRC", help="folder that save_pretrained wrote the FastLoRA adapter to")
    export.add_argument("dst", metavar="DST", help="folder to write the plain LoRA adapter to")
    export.add_argument(
        "--subfolder",
        metavar="NAME",
        help="the adapter's subfolder in SRC (save_pretrained puts adapters not named 'default' in one)",
    )
    export.add_argument("--overwrite", action="store_true", help="write into DST even if it exists and is not empty")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Runs the command line; returns the exit status (0 ok, 1 failed, 2 bad usage)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "export-lora":
        from .export import export_lora

        try:
            out = export_lora(args.src, args.dst, subfolder=args.subfolder, overwrite=args.overwrite)
        except (OSError, ValueError) as err:
            print(f"{parser.prog} export-lora: error: {err}", file=sys.stderr)
            return 1
        print(f"Wrote a plain LoRA adapter to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
