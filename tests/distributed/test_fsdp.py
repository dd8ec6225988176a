"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on CPU with gloo, 2 processes.

torch 2.13 runs ``fully_shard`` on CPU: parameters become DTensors sharded over a gloo mesh, and FastLoRA layers
read the all-gathered 4-bit weight in their forward (its ``quant_state`` re-attached from the bitsandbytes module).
Checks per scenario: no error, the adapters after training equal a single-process run's (within tolerance), and
``peft_fastlora.distributed.save_adapter`` writes the same files and tensors as a single-process ``save_pretrained``
(bit for bit before training).
"""


import pytest

from tests.distributed import _common as C
from tests.distributed import _launch as L

# fp32 storage with fp32 adapters (nothing to cast); bf16 storage with `adapter_dtype="fp32"` (cast to bf16, one
# log line), FSDP mixed precision, gradient checkpointing and modules_to_save, all on the LoraLinearFunction path.
SCENARIOS = ["fp32-st-a32", "bf16-st-a32-mp-gc-mts"]
# lora_A / lora_B as FSDP units of their own (what PEFT's fsdp_auto_wrap_policy does; the Trainer installs it).
ADAPTER_UNITS = "fp32-st-leaf"


@pytest.fixture(scope="module")
def fsdp_results(tiny_llama_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    proc = L.run(
        L.torchrun("tests.distributed.fsdp_worker", "--model", str(tiny_llama_path), "--out", str(out),
                   "--scenarios", ",".join([*SCENARIOS, ADAPTER_UNITS])),
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
    # The all-gathered packed 4-bit bytes are the bytes that were sharded (on the GPUs they were not: see docs).
    packed = result["packed_bytes"]
    assert packed["layers"] > 0 and packed["changed_bytes"] == 0, packed


def test_fsdp_adapter_dtype_follows_storage(fsdp_results):
    """``adapter_dtype="fp32"`` with bf16 storage: adapters become bf16 and exactly one line says so."""
    result = fsdp_results["bf16-st-a32-mp-gc-mts"]
    assert "error" not in result, L.explain(result)
    assert result["adapter_dtypes"] == ["torch.bfloat16"]
    assert len(result["prepare_log"]) == 1, result["prepare_log"]
    line = result["prepare_log"][0]
    assert "adapter_dtype='fp32'" in line and "torch.bfloat16" in line and "bnb_4bit_quant_storage" in line
    assert result["save_trained"]["dtypes"] == ["torch.bfloat16"]
    # fp32 storage with fp32 adapters: nothing to change, nothing logged.
    assert fsdp_results["fp32-st-a32"]["prepare_log"] == []


def test_fsdp_adapter_units(fsdp_results):
    """A FastLoRA layer must call FSDP-wrapped ``lora_A``/``lora_B`` as modules: only their forward unshards them."""
    result = fsdp_results[ADAPTER_UNITS]
    assert "error" not in result, L.explain(result)
    assert result["comparison"]["ok"], result["comparison"]
    assert result["save_trained"]["ok"], result["save_trained"]
