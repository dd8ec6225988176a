"""Runs a distributed worker as a subprocess (``torchrun`` / ``accelerate launch``) on CPU and reads its results."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.distributed import _common as C

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env() -> dict[str, str]:
    """Environment of a CPU worker: gloo, one thread per process, Triton interpreted, no NVLink multicast."""
    return {
        **os.environ,
        **C.NCCL_SAFE_ENV,
        "OMP_NUM_THREADS": "1",
        "TRITON_INTERPRET": "1",
        "FASTLORA_DIST_CPU": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "TOKENIZERS_PARALLELISM": "false",
    }


def torchrun(module: str, *args: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", module, *args]


def accelerate_launch(config: str, module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(HERE / config),
            "--main_process_port", str(free_port()), "-m", module, *args]


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Runs ``cmd`` from the repository root; on failure the assertion message carries the output tail."""
    proc = subprocess.run(cmd, cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=timeout)
    proc.tail = (proc.stdout + proc.stderr)[-6000:]
    return proc


def explain(result: dict) -> str:
    return result.get("traceback") or str({k: v for k, v in result.items() if k != "traceback"})
