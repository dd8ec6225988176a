"""Writes ``SUMMARY.md`` for ``tests/distributed/run_gpu.sh``: ``python -m tests.distributed.summarize OUTDIR``.

Reads the per-step status lines (``steps.tsv``: name, exit code, seconds, log) and the workers' JSON results
(``results/{ddp,fsdp,trainer}-*.json``, ``device_map.json``), and prints one line per check.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _fmt(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _result_line(kind: str, name: str, r: dict) -> str:
    if "error" in r:
        return f"| {kind} | {name} | FAIL | {r['error'][:200]} |"
    c = r.get("comparison", {})
    details = [
        f"max|diff|={_fmt(c.get('max_abs_diff'))} (atol {c.get('atol')}, rtol {c.get('rtol')})",
        f"update={_fmt(r.get('update_size'))}",
    ]
    if r.get("no_grad_params"):
        details.append(f"no grad: {r['no_grad_params'][:3]}")
    packed = r.get("packed_bytes")
    if packed:
        details.append(f"packed bytes changed {packed.get('changed_bytes')}/{packed.get('bytes')}"
                       + (f", {packed['ignored_params']} weights not sharded" if packed.get("ignored_params") else ""))
    if r.get("control"):
        details.append("control: PASS means FSDP2 without the uint8 view did corrupt the packed bytes")
    if "replicas_identical" in r:
        details.append(f"replicas identical={r['replicas_identical']}")
    for key in ("save_init", "save_trained"):
        if key in r:
            details.append(f"{key} ok={r[key].get('ok')}")
    if r.get("prepare_log"):
        details.append(f"log: {r['prepare_log'][0][:120]}")
    if "distributed_type" in r:
        details.append(r["distributed_type"])
    return f"| {kind} | {name} | {'PASS' if r.get('ok') else 'FAIL'} | {'; '.join(details)} |"


def main(out: Path) -> int:
    lines = ["# FastLoRA multi-GPU checks", "", "## Steps", ""]
    lines += ["| step | exit code | seconds | log |", "|---|---|---|---|"]
    steps = out / "steps.tsv"
    failed = 0
    if steps.exists():
        for row in steps.read_text().splitlines():
            name, rc, secs, log = row.split("\t")
            failed += rc != "0"
            lines.append(f"| {name} | {rc}{' (timeout)' if rc in ('124', '137') else ''} | {secs} | {log} |")
    lines += ["", "## Checks", "", "| kind | scenario | result | details |", "|---|---|---|---|"]
    for path in sorted((out / "results").glob("*.json")):
        kind, _, name = path.stem.partition("-")
        result = json.loads(path.read_text())
        failed += not result.get("ok")
        lines.append(_result_line(kind, name, result))
    report = out / "device_map.json"
    if report.exists():
        lines += ["", "## device_map over 2 GPUs", "", "```json", report.read_text(), "```"]
    elif steps.exists() and "device_map\t0\t" in steps.read_text():
        failed += 1  # exit code 0 without a report: the test was skipped (fewer than 2 GPUs?)
        lines += ["", "device_map: pytest passed but wrote no report, so the test was SKIPPED (fewer than 2 GPUs?)"]
    lines += ["", f"**{'ALL PASSED' if not failed else f'{failed} FAILED'}**"]
    (out / "SUMMARY.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
