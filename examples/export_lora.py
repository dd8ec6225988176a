"""Export a FastLoRA adapter as a plain PEFT LoRA adapter, loadable without peft_fastlora (stock PEFT, vLLM, ...).

A FastLoRA adapter already has LoRA's tensors and key names; the export copies the weights byte for byte and
writes an ``adapter_config.json`` with ``"peft_type": "LORA"`` and without the FastLoRA-only fields.

    python examples/export_lora.py /tmp/fastlora/sft /tmp/fastlora/sft-lora
    python -c "from peft import PeftConfig; print(PeftConfig.from_pretrained('/tmp/fastlora/sft-lora').peft_type)"

A thin wrapper around ``peft_fastlora.export_lora``; the installed command ``peft-fastlora export-lora SRC DST`` does
the same. See docs/saving.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

from peft_fastlora import export_lora


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path, help="Folder that save_pretrained wrote the FastLoRA adapter to.")
    parser.add_argument("dst", type=Path, help="Folder to write the plain LoRA adapter to.")
    parser.add_argument("--subfolder", default=None, help="The adapter's subfolder in src (adapters not named "
                        "'default' are saved in one).")  # fmt: skip
    parser.add_argument("--overwrite", action="store_true", help="Write into dst even if it is not empty.")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    try:
        dst = export_lora(args.src, args.dst, subfolder=args.subfolder, overwrite=args.overwrite)
    except (OSError, ValueError) as err:
        raise SystemExit(f"export_lora.py: error: {err}") from None
    config = json.loads((dst / "adapter_config.json").read_text())
    files = sorted(p.name for p in dst.iterdir())
    print(f"Exported {args.src} -> {dst} (peft_type={config['peft_type']}): {files}")


if __name__ == "__main__":
    main()
