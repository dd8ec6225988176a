"""The command line: ``peft-fastlora {export-lora,merge}`` (also ``python -m peft_fastlora ...``).

Only stdlib at the top: ``--help`` and ``--version`` must answer without importing torch, transformers or PEFT
(seconds of CPU). Running the CLI imports the package first, and the package's import registers FastLoRA with PEFT,
which needs all of them; so ``peft_fastlora/__init__.py`` imports this module before anything else, and importing it
runs [`answer_help_or_version`], which in a CLI process answers help, the version and usage errors (and exits), and
does nothing in any other. Each command imports what it needs.
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib import metadata
from pathlib import Path
from typing import Optional

PROG = "peft-fastlora"
EXPORT_HELP = """\
Write a plain PEFT LoRA copy of a FastLoRA adapter: the same weights (the safetensors file copied byte for byte; a
pickle adapter_model.bin converted to safetensors), an adapter_config.json with "peft_type": "LORA" and without the
FastLoRA-only fields, and a README. Stock PEFT (without peft_fastlora), vLLM and other LoRA consumers load the copy.
Every source file is checked before anything is written; DST changes only when the export succeeds."""
MERGE_HELP = """\
Write a plain (unquantized) transformers checkpoint of BASE with ADAPTER merged in: the base model is loaded as the
adapter was trained on it (the quantization its model card records), every quantized layer is dequantized, the
adapter is added to the dequantized weights (no requantization: lossless up to the output dtype's rounding), and the
model is saved with save_pretrained (safetensors) into DST, written beside DST and then moved into place. Loads with
AutoModelFor*.from_pretrained(DST) without peft or bitsandbytes."""


def version() -> str:
    """The installed distribution's version (the package metadata is the one source of it)."""
    try:
        return metadata.version("peft-fastlora")
    except metadata.PackageNotFoundError:
        return "unknown (peft_fastlora is imported from a source tree that is not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="peft-fastlora command line tools.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
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
    export.add_argument(
        "--overwrite", action="store_true", help="write into DST even if it is not empty (an earlier export only)"
    )
    merge = commands.add_parser(
        "merge",
        help="write a plain 16-bit checkpoint: the dequantized base model with the adapter merged in",
        description=MERGE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    merge.add_argument("base", metavar="BASE", help="the base model: a folder or Hub id (unquantized or pre-quantized)")
    merge.add_argument("adapter", metavar="ADAPTER", help="folder (or Hub id) of a FastLoRA or plain LoRA adapter")
    merge.add_argument("dst", metavar="DST", help="folder to write the merged checkpoint to")
    merge.add_argument("--subfolder", metavar="NAME", help="the adapter's subfolder in ADAPTER")
    merge.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        help="dtype of the saved weights (default: 16-bit, the model or compute dtype the adapter's card records, "
        "else bfloat16)",
    )
    merge.add_argument("--device", default="cpu", help="where to load and merge, e.g. cuda:0 (default: cpu)")
    merge.add_argument(
        "--overwrite", action="store_true", help="replace the checkpoint files in DST if it is not empty"
    )
    return parser


def _is_cli_process() -> bool:
    """Whether this process runs the command line (``python -m peft_fastlora`` or the ``peft-fastlora`` script)."""
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0 == "-m":  # python -m: runpy imports the package (this is during that import) before __main__ runs
        orig = list(getattr(sys, "orig_argv", []))
        modules = [orig[i + 1] for i, arg in enumerate(orig[:-1]) if arg == "-m"]
        modules += [arg[2:] for arg in orig if arg.startswith("-m") and len(arg) > 2]
        return "peft_fastlora" in modules
    return Path(argv0).name in (PROG, f"{PROG}.exe")


def answer_help_or_version() -> None:
    """In a CLI process, parses the arguments before torch is imported: ``--help``, ``--version`` and usage errors
    answer and exit here; valid commands return, to run once the package is imported."""
    if _is_cli_process():
        build_parser().parse_args(sys.argv[1:])


def _which_adapter(folder: str, subfolder: Optional[str], how: str) -> tuple[str, Optional[str]]:
    """Which adapter of ``folder`` a command used, in words, and a line naming the folder's other adapters, if any."""
    from .export import adapter_subfolders

    which = f"the default adapter of {folder}"
    if subfolder:
        which = f"the adapter in the subfolder {subfolder!r} of {folder}"
    others = [name for name in adapter_subfolders(folder) if name != subfolder] if Path(folder).is_dir() else []
    if not others:
        return which, None
    if subfolder and (Path(folder) / "adapter_config.json").is_file():
        others.insert(0, "the default one (no --subfolder)")
    return which, f"{folder} holds other adapters too: {', '.join(others)}. {how} one with `--subfolder NAME`."


def _export(args: argparse.Namespace) -> str:
    from .export import export_lora

    out = export_lora(args.src, args.dst, subfolder=args.subfolder, overwrite=args.overwrite)
    which, others = _which_adapter(args.src, args.subfolder, "Export")
    return "\n".join([f"Exported {which} to {out} (a plain LoRA adapter).", *([others] if others else [])])


def _merge(args: argparse.Namespace) -> str:
    from .checkpoint import export_merged

    out = export_merged(args.base, args.adapter, args.dst, subfolder=args.subfolder, dtype=args.dtype,
                        device=args.device, overwrite=args.overwrite)
    which, others = _which_adapter(args.adapter, args.subfolder, "Merge")
    lines = [f"Wrote a plain checkpoint of {args.base} with {which} merged in to {out}."]
    return "\n".join(lines + ([others] if others else []))


COMMANDS = {"export-lora": _export, "merge": _merge}


def main(argv: Optional[list[str]] = None) -> int:
    """Runs the command line; returns the exit status (0 ok, 1 failed, 2 bad usage)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)  # the library's INFO lines say what a command is doing
    handler.setFormatter(logging.Formatter("%(message)s"))
    package_logger = logging.getLogger("peft_fastlora")
    package_logger.addHandler(handler)
    previous_level = package_logger.level
    package_logger.setLevel(logging.INFO)
    try:
        print(COMMANDS[args.command](args))
    except (OSError, ValueError) as err:  # the library's errors name the argument, the value and the fix
        print(f"{parser.prog} {args.command}: error: {err}", file=sys.stderr)
        return 1
    finally:
        package_logger.removeHandler(handler)
        package_logger.setLevel(previous_level)
    return 0


answer_help_or_version()  # on import, from peft_fastlora/__init__.py: see the module docstring
