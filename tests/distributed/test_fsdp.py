"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on CPU with gloo, 2 processes.

torch 2.13 runs ``fully_shard`` on CPU: parameters become DTensors sharded over a gloo mesh, and FastLoRA layers
read the all-gathered 4-bit weight in their forward (its ``quant_state`` re-attached from the bitsandbytes module).
Checks per scenario: no error, the adapters after training equal a single-process run's (within tolerance),
``peft_fastlora.distributed.save_adapter`` writes the same files and tensors as a single-process ``save_pretrained``
(bit for bit before training), and the all-gathered packed 4-bit bytes are the bytes that were sharded, also under a
CPU simulation of CUDA's NaN-rewriting float copies (``nan``), under which FSDP2 without the uint8 view (``v1``)
must fail.
"""


import pytest

from tests.distributed import _common as C
from tests.distributed import _launch as L

# Minutes of subprocesses or whole training runs: `pytest -m 'not slow'` leaves them out while working on the code.
pytestmark = pytest.mark.slow

# uint8 storage (bitsandbytes' default) with fp32 adapters; bf16 storage with `adapter_dtype="fp32"` (kept: FSDP2 mixed
# precision computes with bf16 copies), FSDP mixed precision, gradient checkpointing and modules_to_save, under the
# CUDA NaN-rewrite simulation; all on the LoraLinearFunction path.
SCENARIOS = ["fp32-a32", "bf16-st-a32-mp-gc-mts-nan"]
# lora_A / lora_B as FSDP units of their own (what PEFT's fsdp_auto_wrap_policy does; the Trainer installs it).
ADAPTER_UNITS = "fp32-st-leaf"
# FSDP2 without the uint8 view (packed weights left as bf16 floats, FSDP1's rule) under the same simulation: must
# corrupt, so the scenarios above can fail.
CONTROL = "bf16-st-mp-nan-v1"


@pytest.fixture(scope="module")
def fsdp_results(tiny_llama_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    proc = L.run(
        L.torchrun("tests.distributed.fsdp_worker", "--model", str(tiny_llama_path), "--out", str(out),
                   "--scenarios", ",".join([*SCENARIOS, ADAPTER_UNITS, CONTROL])),
        timeout=240,
    )
    results = C.read_results(out, "fsdp")
    assert proc.returncode == 0 and results, f"torchrun failed (rc={proc.returncode}):\n{proc.tail}"
    return results


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fsdp2_matches_single_process(fsdp_results, scenario):
    result = fsdp_results.get(scenario)
    assert result is not None, f"no result for {scenario}; got {sorted(fsdp_results)}"
    assert "error" not in result, L.explain(result)
    assert result["no_grad_params"] == []
    assert result["comparison"]["ok"], result["comparison"]
    assert C.meaningful(result, C.Scenario.parse(scenario).tolerance), "training barely moved the adapters"
    assert result["save_init"]["ok"] and result["save_init"]["values"]["exact"], result["save_init"]
    assert result["save_trained"]["ok"] and result["save_trained"]["values"]["exact_to_model"], result["save_trained"]
    # The all-gathered packed 4-bit bytes are the bytes that were sharded.
    packed = result["packed_bytes"]
    assert packed["layers"] > 0 and packed["changed_bytes"] == 0, packed


def test_fsdp2_keeps_adapter_dtype(fsdp_results):
    """``adapter_dtype="fp32"`` under FSDP2: adapters stay fp32 (the bf16 modules_to_save copy stays bf16), saved as
    fp32, and one line says that such mixed trainable dtypes need separate FSDP units."""
    result = fsdp_results["bf16-st-a32-mp-gc-mts-nan"]
    assert "error" not in result, L.explain(result)
    assert result["adapter_dtypes"] == ["torch.bfloat16", "torch.float32"]
    log = _without_old_torch_line(result["prepare_log"])
    assert len(log) == 1 and "several dtypes" in log[0], log
    assert result["save_trained"]["dtypes"] == ["torch.bfloat16", "torch.float32"]
    # uint8 storage, fp32 model and adapters: nothing to say.
    assert _without_old_torch_line(fsdp_results["fp32-a32"]["prepare_log"]) == []


def _without_old_torch_line(lines: list[str]) -> list[str]:
    """torch < 2.12 adds a line: FSDP2 cannot shard the uint8 weights there (they are `ignored_params`)."""
    return [line for line in lines if "cannot shard uint8 parameters" not in line]


def test_nan_rewrite_simulation_bites_without_the_fix(fsdp_results):
    """Packed weights left as bf16 (FSDP1's rule) all-gathered by FSDP2 under the CUDA simulation: bytes change and
    training drifts from one process, as on the GPUs. So the zero in the other scenarios means something."""
    result = fsdp_results[CONTROL]
    assert "error" not in result, L.explain(result)
    assert result["control"] and result["ok"]
    assert result["packed_bytes"]["changed_bytes"] > 0, result["packed_bytes"]
    assert not result["comparison"]["ok"], result["comparison"]


def test_fsdp_adapter_units(fsdp_results):
    """A FastLoRA layer must call FSDP-wrapped ``lora_A``/``lora_B`` as modules: only their forward unshards them."""
    result = fsdp_results[ADAPTER_UNITS]
    assert "error" not in result, L.explain(result)
    assert result["comparison"]["ok"], result["comparison"]
    assert result["save_trained"]["ok"], result["save_trained"]
