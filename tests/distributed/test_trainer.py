"""``accelerate launch`` (2 processes, gloo on CPU) with the HF Trainer: gradient checkpointing, ``modules_to_save``,
``ddp_find_unused_parameters=False``; the adapter saved by ``trainer.save_model`` must equal a single-process run's.

``accelerate launch --cpu --num_processes 2`` starts a single process (accelerate's multi-CPU launcher needs mpirun),
so the launch uses ``accelerate_ddp.yaml`` (torchrun under the hood) and the script passes ``use_cpu=True``.
"""

import pytest

from tests.distributed import _common as C
from tests.distributed import _launch as L

# Minutes of subprocesses or whole training runs: `pytest -m 'not slow'` leaves them out while working on the code.
pytestmark = pytest.mark.slow

SCENARIO = "fp32-gc-mts"


def test_accelerate_trainer_ddp_matches_single_process(tiny_llama_path, tmp_path):
    proc = L.run(
        L.accelerate_launch("accelerate_ddp.yaml", "tests.distributed.trainer_worker", "--model", str(tiny_llama_path),
                            "--out", str(tmp_path), "--scenario", SCENARIO, "--cpu"),
        timeout=240,
    )
    result = C.read_results(tmp_path, "trainer").get(SCENARIO)
    assert result is not None, f"accelerate launch failed (rc={proc.returncode}):\n{proc.tail}"
    assert "error" not in result, L.explain(result)
    assert proc.returncode == 0, proc.tail
    assert result["world_size"] == 2 and result["distributed_type"].endswith("MULTI_CPU")
    assert result["comparison"]["ok"], f"saved adapter differs from the single-process run: {result['comparison']}"
    assert C.meaningful(result, C.Scenario.parse(SCENARIO).tolerance), "training barely moved the adapters"
    assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-4)
