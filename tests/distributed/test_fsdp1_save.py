"""FSDP1 (``FullyShardedDataParallel``) save on CPU with gloo, 2 processes, the way the HF Trainer saves under
accelerate's FSDP1 plugin (see ``fsdp1_save_worker``).

PEFT matches the tuner layers' module names, which under nested FSDP1 units read
``...layers.0._fsdp_wrapped_module.self_attn.q_proj``, against the gathered keys ``...layers.0.self_attn.q_proj...``,
and reads the FSDP1 ``modules_to_save`` unit's ``state_dict()`` (a collective) on rank 0 alone. Without FastLoRA's
two save fixes (``_registry.hook_adapter_state_dict``, ``distributed.fsdp1_module_state_from``) the adapter file
holds only ``lm_head``, or the save hangs.
"""

import pytest

from tests.distributed import _common as C
from tests.distributed import _launch as L

# Minutes of subprocesses or whole training runs: `pytest -m 'not slow'` leaves them out while working on the code.
pytestmark = pytest.mark.slow

SCENARIO = "bf16-st-a32-gc-mts"


def test_fsdp1_full_state_dict_saves_every_adapter_tensor(tiny_llama_path, tmp_path):
    proc = L.run(
        L.torchrun("tests.distributed.fsdp1_save_worker", "--model", str(tiny_llama_path), "--out", str(tmp_path),
                   "--scenarios", SCENARIO),
        timeout=200,
    )
    result = C.read_results(tmp_path, "fsdp1-save").get(SCENARIO)
    assert result is not None, f"torchrun failed (rc={proc.returncode}):\n{proc.tail}"
    assert "error" not in result, L.explain(result)
    assert result["nested_wrapper_names"] > 0, "no nested FSDP1 units: the test does not exercise the bug"
    assert not result["missing"] and not result["extra"], result
    assert result["equal"], "saved tensors differ from the gathered state dict"
    assert result["ok"] and proc.returncode == 0, proc.tail
