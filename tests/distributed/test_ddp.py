"""DDP on CPU (gloo): ``torchrun --nproc-per-node 2`` trains a tiny 4-bit FastLoRA model.

One launch runs every scenario (see ``_common``); each must raise no DDP error with ``find_unused_parameters=False``
(any trainable parameter without a gradient fails the next step), keep both replicas bit-identical, and end with the
adapters of a single-process run on the same global batch within the scenario's tolerance.
"""

import pytest

from tests.distributed import _common as C
from tests.distributed import _launch as L

# Minutes of subprocesses or whole training runs: `pytest -m 'not slow'` leaves them out while working on the code.
pytestmark = pytest.mark.slow

# fp32: pure-torch reference path; the others run LoraLinearFunction (the CUDA autograd path, Triton interpreted).
SCENARIOS = ["fp32-ref", "fp32", "fp32-gc", "fp32-gcr", "fp32-mts"]


@pytest.fixture(scope="module")
def ddp_results(tiny_llama_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    proc = L.run(
        L.torchrun("tests.distributed.ddp_worker", "--model", str(tiny_llama_path), "--out", str(out),
                   "--scenarios", ",".join(SCENARIOS)),
        timeout=240,
    )
    results = C.read_results(out, "ddp")
    assert proc.returncode == 0 and results, f"torchrun failed (rc={proc.returncode}):\n{proc.tail}"
    return results


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ddp_matches_single_process(ddp_results, scenario):
    result = ddp_results.get(scenario)
    assert result is not None, f"no result for {scenario}; got {sorted(ddp_results)}"
    assert "error" not in result, L.explain(result)
    assert result["world_size"] == 2
    assert result["no_grad_params"] == [], "trainable parameters without a gradient (DDP would fail next step)"
    assert result["replicas_identical"], "DDP replicas diverged"
    assert result["save_matches_model"], "save_adapter through the DDP wrapper wrote other tensors"
    comparison = result["comparison"]
    assert comparison["ok"], f"adapters differ from the single-process run: {comparison}"
    assert C.meaningful(result, C.Scenario.parse(scenario).tolerance), "training barely moved the adapters"
    assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-4)
