"""The multi-GPU driver script parses, and refuses to run without an output folder."""

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).with_name("run_gpu.sh")


def test_run_gpu_sh_parses_and_asks_for_outdir():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode != 0 and "usage: bash tests/distributed/run_gpu.sh OUTDIR" in proc.stderr
