"""Saving and loading FastLoRA adapters: standard files and keys, exact round trips, dtype policies, adapters."""

import json
import re
import warnings
from types import SimpleNamespace

import pytest
import torch
from peft import AutoPeftModelForCausalLM, PeftConfig, PeftModel, get_peft_model
from peft.tuners.lora import Linear as PeftLoraLinear
from safetensors.torch import load_file, save_file

import peft_fastlora
from peft_fastlora.bnb import FastLoraLinear4bit, FastLoraLinear8bit
from tests.utils import adapter_tensors, assert_same_tensors, bnb_config, load_quantized, logits, tokens
from tests.utils import fast_config as shared_fast_config

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# name -> (bnb_config kwargs, model dtype)
QUANTS = {
    "nf4-bf16": (dict(bits=4, quant_type="nf4", compute_dtype=BF16), BF16),
    "fp4-fp16-dq": (dict(bits=4, quant_type="fp4", compute_dtype=FP16, double_quant=True), FP16),
    "nf4-fp32-dq-storage-bf16": (dict(bits=4, compute_dtype=FP32, double_quant=True, quant_storage=BF16), FP32),
    "int8-fp16": (dict(bits=8), FP16),
}
# (policy, compute dtype) -> adapter dtype: the table of peft_fastlora/dtypes.py, written out independently.
POLICY_TABLE = {
    ("bf16", FP16): BF16, ("bf16", BF16): BF16, ("bf16", FP32): BF16,
    ("fp32-if-fp16", FP16): FP32, ("fp32-if-fp16", BF16): BF16, ("fp32-if-fp16", FP32): FP32,
    ("fp32", FP16): FP32, ("fp32", BF16): FP32, ("fp32", FP32): FP32,
}  # fmt: skip


def fast_config(**kwargs) -> peft_fastlora.FastLoraConfig:
    return shared_fast_config(**{"r": 4, "lora_alpha": 8, **kwargs})


def load_base(path, quant: str):
    bnb_kwargs, dtype = QUANTS[quant]
    return load_quantized(path, dtype=dtype, **bnb_kwargs)


def train_one_step(model) -> None:
    """One AdamW step, so lora_B is non-zero and the saved adapter is not the initialization."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    ids = tokens().to(params[0].device)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model.eval()


def no_key_warnings(caught) -> None:
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if re.search(r"missing|unexpected", m, re.IGNORECASE)], messages


@pytest.fixture(scope="module", params=list(QUANTS))
def saved(request, tiny_llama_path, tmp_path_factory):
    """A FastLoRA model trained one step on each quantized base, saved; with its tensors and logits."""
    torch.manual_seed(0)
    model = get_peft_model(load_base(tiny_llama_path, request.param), fast_config())
    train_one_step(model)
    out = tmp_path_factory.mktemp(f"adapter-{request.param}")
    model.save_pretrained(out)
    return SimpleNamespace(
        quant=request.param, path=out, model=model, tensors=adapter_tensors(model), logits=logits(model)
    )


# ---- files and keys ------------------------------------------------------------------------------------------------
def test_standard_files_and_lora_keys(saved):
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= {p.name for p in saved.path.iterdir()}
    config = json.loads((saved.path / "adapter_config.json").read_text())
    assert config["peft_type"] == "FASTLORA"
    assert config["adapter_dtype"] == "fp32-if-fp16"
    state = load_file(saved.path / "adapter_model.safetensors")
    assert len(state) == 2 * 2 * 7  # (A, B) x 2 decoder layers x (q, k, v, o, gate, up, down)
    key = re.compile(r"base_model\.model\.model\.layers\.\d\.\w+\.\w+_proj\.lora_[AB]\.weight")
    assert all(key.fullmatch(k) for k in state)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in state
    assert_same_tensors(state, saved.tensors)  # the file holds exactly the model's adapter tensors
    assert any(v.abs().max() > 0 for k, v in state.items() if "lora_B" in k)  # trained: not the zero init


@pytest.mark.parametrize("policy", peft_fastlora.ADAPTER_DTYPE_POLICIES)
@pytest.mark.parametrize("guard", [False, True])
def test_peft_config_from_pretrained_is_a_fastlora_config(tmp_path, policy, guard):
    fast_config(adapter_dtype=policy, fp16_overflow_guard=guard, r=6).save_pretrained(tmp_path)
    config = PeftConfig.from_pretrained(tmp_path)
    assert type(config) is peft_fastlora.FastLoraConfig
    assert config.peft_type == "FASTLORA" and config.peft_type is peft_fastlora.FastLoraConfig().peft_type
    assert (config.adapter_dtype, config.fp16_overflow_guard, config.r) == (policy, guard, 6)


def test_saved_config_round_trips(saved):
    config = PeftConfig.from_pretrained(saved.path)
    assert type(config) is peft_fastlora.FastLoraConfig
    assert config.adapter_dtype == saved.model.peft_config["default"].adapter_dtype
    assert config.target_modules == saved.model.peft_config["default"].target_modules


# ---- round trips ---------------------------------------------------------------------------------------------------
def _from_pretrained(saved, tiny_llama_path):
    return PeftModel.from_pretrained(load_base(tiny_llama_path, saved.quant), saved.path), "default"


def _auto_peft_model(saved, tiny_llama_path):
    bnb_kwargs, dtype = QUANTS[saved.quant]
    return AutoPeftModelForCausalLM.from_pretrained(saved.path, quantization_config=bnb_config(**bnb_kwargs),
                                                    dtype=dtype), "default"


def _load_adapter(saved, tiny_llama_path):
    model = get_peft_model(load_base(tiny_llama_path, saved.quant), fast_config(r=2))
    result = model.load_adapter(saved.path, adapter_name="other")
    assert not result.missing_keys and not result.unexpected_keys
    model.set_adapter("other")
    return model, "other"


@pytest.mark.parametrize("load", [_from_pretrained, _auto_peft_model, _load_adapter])
def test_round_trip_is_exact(saved, tiny_llama_path, load):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, name = load(saved, tiny_llama_path)
    no_key_warnings(caught)
    layers = [m for m in model.modules() if isinstance(m, peft_fastlora.FastLoraLayer)]
    assert len(layers) == 14
    assert all(type(m) is (FastLoraLinear8bit if saved.quant.startswith("int8") else FastLoraLinear4bit)
               for m in layers)
    assert isinstance(model.peft_config[name], peft_fastlora.FastLoraConfig)
    assert_same_tensors(adapter_tensors(model, name), saved.tensors)
    assert torch.equal(logits(model), saved.logits)


def test_from_pretrained_is_trainable_keeps_policy_and_trains(saved, tiny_llama_path):
    model = PeftModel.from_pretrained(load_base(tiny_llama_path, saved.quant), saved.path, is_trainable=True)
    assert_same_tensors(adapter_tensors(model), saved.tensors)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    train_one_step(model)  # and training goes on, in the same dtypes
    assert {k: v.dtype for k, v in adapter_tensors(model).items()} == {k: v.dtype for k, v in saved.tensors.items()}


# ---- dtypes --------------------------------------------------------------------------------------------------------
def _write_adapter(src, dst, tensor_dtype, policy):
    """A copy of the adapter at ``src`` with its tensors stored in ``tensor_dtype`` and ``adapter_dtype=policy``."""
    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**config, "adapter_dtype": policy}))
    state = {k: v.to(tensor_dtype) for k, v in load_file(src / "adapter_model.safetensors").items()}
    save_file(state, dst / "adapter_model.safetensors")
    return state


@pytest.fixture(scope="module")
def random_adapter(tiny_llama_path, tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("random-adapter")
    get_peft_model(load_base(tiny_llama_path, "nf4-bf16"), fast_config(init_lora_weights=False)).save_pretrained(path)
    return path


@pytest.mark.parametrize("policy", peft_fastlora.ADAPTER_DTYPE_POLICIES)
@pytest.mark.parametrize("compute", [FP16, BF16, FP32])
def test_saved_dtype_loads_in_policy_dtype(tiny_llama_path, random_adapter, tmp_path, policy, compute):
    """Adapters stored in fp16, bf16 or fp32 load in the dtype the policy gives, whatever autocast_adapter_dtype."""
    base = load_quantized(tiny_llama_path, dtype=compute, compute_dtype=compute)
    expected = POLICY_TABLE[(policy, compute)]
    model = None
    for stored in (FP16, BF16, FP32):
        state = _write_adapter(random_adapter, tmp_path / str(stored)[6:], stored, policy)
        for autocast in (True, False):
            name = f"{str(stored)[6:]}_autocast_{autocast}"
            if model is None:
                model = PeftModel.from_pretrained(base, tmp_path / str(stored)[6:], adapter_name=name,
                                                  autocast_adapter_dtype=autocast)
            else:
                model.load_adapter(tmp_path / str(stored)[6:], adapter_name=name, autocast_adapter_dtype=autocast)
            assert_same_tensors(adapter_tensors(model, name), {k: v.to(expected) for k, v in state.items()})
            layers = [m for m in model.modules() if isinstance(m, peft_fastlora.FastLoraLayer)]
            assert all(m.adapter_dtypes[name] == expected for m in layers)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*outside peft_fastlora.*")  # no recast needed at forward time
        out = logits(model)
    assert out.dtype == compute and out.isfinite().all()


# PeftModel.from_pretrained(..., low_cpu_mem_usage=True) assigns the saved tensors, then PEFT's
# `_move_adapter_to_device_of_base_layer` would cast them to the base layer's compute dtype before the policy casts
# them back, rounding fp32 adapters of an fp16/bf16-compute base through 16 bits; FastLoraLayer moves them in the
# policy dtype instead. This is the regression test.
def test_low_cpu_mem_usage_load_keeps_policy(saved, tiny_llama_path):
    model = PeftModel.from_pretrained(load_base(tiny_llama_path, saved.quant), saved.path, low_cpu_mem_usage=True)
    assert_same_tensors(adapter_tensors(model), saved.tensors)
    assert torch.equal(logits(model), saved.logits)


# ---- several adapters ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_adapters(tiny_llama_path):
    """A bf16 nf4 base with 'default' (fp32-if-fp16 -> bf16), 'second' (fp32 policy) and 'zero' (B = 0)."""
    torch.manual_seed(0)
    model = get_peft_model(load_base(tiny_llama_path, "nf4-bf16"), fast_config(init_lora_weights=False))
    model.add_adapter("second", fast_config(r=2, lora_alpha=4, init_lora_weights=False, adapter_dtype="fp32",
                                       target_modules=["q_proj", "v_proj", "down_proj"]))
    model.add_adapter("zero", fast_config(r=2))
    return model.eval()


def test_add_adapter_with_another_policy(two_adapters):
    dtypes = {name: {v.dtype for v in adapter_tensors(two_adapters, name).values()} for name in ("default", "second")}
    assert dtypes == {"default": {BF16}, "second": {FP32}}
    q_proj = two_adapters.base_model.model.model.layers[0].self_attn.q_proj
    assert q_proj.adapter_dtypes["default"] == BF16 and q_proj.adapter_dtypes["second"] == FP32


def test_set_adapter_and_disable_adapter(two_adapters):
    outs = {}
    for name in ("default", "second", "zero"):
        two_adapters.set_adapter(name)
        outs[name] = logits(two_adapters)
    with two_adapters.disable_adapter():
        outs["disabled"] = logits(two_adapters)
    two_adapters.set_adapter("default")
    assert torch.equal(logits(two_adapters), outs["default"])  # set_adapter switches back exactly
    torch.testing.assert_close(outs["disabled"], outs["zero"])  # B = 0 adds nothing
    for name in ("default", "second"):
        assert (outs[name] - outs["disabled"]).abs().max() > 0.05  # each adapter changes the output
    assert (outs["default"] - outs["second"]).abs().max() > 0.05


def test_mixed_batch_matches_per_adapter_forwards(two_adapters):
    names = ["second", "__base__", "default", "second", "default"]
    ids = tokens(rows=len(names))
    expected = {}
    for name in ("default", "second"):
        two_adapters.set_adapter(name)
        expected[name] = logits(two_adapters, ids)
    with two_adapters.disable_adapter():
        expected["__base__"] = logits(two_adapters, ids)
    two_adapters.set_adapter("default")
    mixed = logits(two_adapters, ids, adapter_names=names)
    for row, name in enumerate(names):
        # bf16 logits: the mixed path adds each adapter's term separately from the base matmul, so roundings differ
        torch.testing.assert_close(mixed[row], expected[name][row], atol=2e-2, rtol=2e-2)
    # and the rows really come from different adapters
    assert (mixed[0] - expected["default"][0]).abs().max() > 0.05


def test_several_adapters_save_and_load(two_adapters, tiny_llama_path, tmp_path):
    two_adapters.save_pretrained(tmp_path, selected_adapters=["default", "second"])
    assert (tmp_path / "adapter_config.json").is_file() and (tmp_path / "second" / "adapter_config.json").is_file()
    assert not (tmp_path / "zero").exists()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(load_base(tiny_llama_path, "nf4-bf16"), tmp_path)
        result = model.load_adapter(tmp_path, adapter_name="second", subfolder="second")
    no_key_warnings(caught)
    assert not result.missing_keys and not result.unexpected_keys
    assert model.peft_config["second"].adapter_dtype == "fp32"
    for name in ("default", "second"):
        assert_same_tensors(adapter_tensors(model, name), adapter_tensors(two_adapters, name))
    names = ["second", "default", "__base__"]
    ids = tokens(rows=3)
    assert torch.equal(logits(model, ids, adapter_names=names), logits(two_adapters, ids, adapter_names=names))


# ---- targets that are not quantized --------------------------------------------------------------------------------
@pytest.mark.parametrize("quant", ["nf4-bf16", "fp4-fp16-dq", "int8-fp16"])
def test_unquantized_target_gets_peft_lora_linear(tiny_llama_path, tmp_path, quant):
    torch.manual_seed(0)
    # every quantized layer is targeted too: bitsandbytes' own CPU eval forward fails on in_features=96 (its CPU
    # repacking assumes in_features is a multiple of the blocksize), and only FastLoRA layers avoid it
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    config = fast_config(target_modules=targets, init_lora_weights=False)
    model = get_peft_model(load_base(tiny_llama_path, quant), config)
    lm_head = model.base_model.model.lm_head
    assert type(lm_head) is PeftLoraLinear and not isinstance(lm_head, peft_fastlora.FastLoraLayer)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, FastLoraLinear8bit if quant.startswith("int8") else FastLoraLinear4bit)
    # lm_head computes in the model dtype; the policy resolves against it
    model_dtype = QUANTS[quant][1]
    assert lm_head.lora_A["default"].weight.dtype == POLICY_TABLE[("fp32-if-fp16", model_dtype)]
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(load_base(tiny_llama_path, quant), tmp_path)
    assert type(loaded.base_model.model.lm_head) is PeftLoraLinear
    assert_same_tensors(adapter_tensors(loaded), adapter_tensors(model))
    assert torch.equal(logits(loaded), logits(model))



@pytest.mark.parametrize("trained, loaded", [("int8-fp16", "fp4-fp16-dq"), ("fp4-fp16-dq", "int8-fp16")])
def test_adapter_loaded_on_another_quantization_warns(tiny_llama_path, tmp_path, trained, loaded):
    """The card records the training quantization; loading on a base with another bit width says so."""
    get_peft_model(load_base(tiny_llama_path, trained), fast_config(init_lora_weights=False)).save_pretrained(tmp_path)
    bits = {"int8-fp16": 8, "fp4-fp16-dq": 4}
    with pytest.warns(UserWarning, match=rf"trained on a {bits[trained]}-bit base model .* is {bits[loaded]}-bit"):
        PeftModel.from_pretrained(load_base(tiny_llama_path, loaded), tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        PeftModel.from_pretrained(load_base(tiny_llama_path, trained), tmp_path)


def test_ungathered_zero3_style_save_warns(tiny_llama_path, tmp_path):
    """PEFT's check for lora tensors saved as un-gathered shards (1-D / empty) runs for FASTLORA as for LORA."""
    model = get_peft_model(load_base(tiny_llama_path, "nf4-bf16"), fast_config())
    name, param = next((n, p) for n, p in model.named_parameters() if "lora_A" in n)
    param.data = torch.empty(0, dtype=param.dtype)  # what a ZeRO-3 partitioned parameter looks like outside a gather
    with pytest.warns(UserWarning, match=r"LoRA tensor\(s\) have invalid shape.*ZeRO-3 / FSDP"):
        model.save_pretrained(tmp_path)
