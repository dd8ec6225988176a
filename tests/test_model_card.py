"""The FastLoRA section of README.md: metadata, usage snippet, dtypes, quantization; one copy however often saved."""

import re
import warnings

import pytest
import torch
from huggingface_hub import ModelCard
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict
from transformers import AutoModelForCausalLM

import peft_fastlora
from peft_fastlora import model_card
from tests.utils import load_quantized

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
HEADING = "## Using this adapter"


def fast_config(**kwargs):
    return peft_fastlora.FastLoraConfig(
        **{"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "task_type": "CAUSAL_LM", **kwargs}
    )


def saved_card(model, path) -> ModelCard:
    model.save_pretrained(path)
    return ModelCard.load(path / "README.md")


def python_block(text: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    assert len(blocks) == 1, blocks
    return blocks[0]


def assert_one_section(text: str) -> None:
    assert text.count(HEADING) == 1
    assert text.count(model_card.BLOCK_START) == 1 and text.count(model_card.BLOCK_END) == 1
    assert text.count(model_card.FACTS_PREFIX) == 1


def test_nf4_card(tiny_llama_path, tmp_path):
    model = get_peft_model(load_quantized(tiny_llama_path, dtype=BF16), fast_config())
    card = saved_card(model, tmp_path)
    base = str(tiny_llama_path)
    assert card.data.library_name == "peft"
    assert card.data.base_model == base
    assert {"fastlora", "lora", "qlora", f"base_model:adapter:{base}"} <= set(card.data.tags)
    text = card.text
    assert_one_section(text)
    assert "pip install peft-fastlora" in text and model_card.install_commands() in text
    assert "python -m peft_fastlora export-lora" in text and "python -m peft_fastlora merge" in text
    code = python_block(text)
    assert "import peft_fastlora" in code
    assert code.index("import peft_fastlora") < code.index("PeftModel.from_pretrained")
    for arg in ("load_in_4bit=True", 'bnb_4bit_quant_type="nf4"', "bnb_4bit_compute_dtype=torch.bfloat16",
                "bnb_4bit_use_double_quant=False", "bnb_4bit_quant_storage=torch.uint8"):
        assert arg in code, arg
    assert "AutoPeftModelForCausalLM" in code and "dtype=torch.bfloat16" in code
    # the policy, and the dtype it resolved to on this bf16-compute base
    assert re.search(r"\| default \| `\.` \| `fp32-if-fp16` \| bf16 \| 4 \| 8 \|", text)
    assert "`fp32-if-fp16`: fp32 adapters under fp16 compute" in text
    assert "4-bit nf4, compute dtype bfloat16, double quantization: no, quant_storage: uint8" in text


def test_fp4_double_quant_fp16_card(tiny_llama_path, tmp_path):
    base = load_quantized(tiny_llama_path, dtype=FP16, quant_type="fp4", compute_dtype=FP16, double_quant=True,
                          quant_storage=BF16)
    card = saved_card(get_peft_model(base, fast_config()), tmp_path)
    code = python_block(card.text)
    for arg in ('bnb_4bit_quant_type="fp4"', "bnb_4bit_compute_dtype=torch.float16",
                "bnb_4bit_use_double_quant=True", "bnb_4bit_quant_storage=torch.bfloat16", "dtype=torch.float16"):
        assert arg in code, arg
    assert re.search(r"\| default \| `\.` \| `fp32-if-fp16` \| fp32 \|", card.text)  # fp16 compute -> fp32
    assert "4-bit fp4, compute dtype float16, double quantization: yes, quant_storage: bfloat16" in card.text
    assert "qlora" in card.data.tags


def test_int8_card(tiny_llama_path, tmp_path):
    base = load_quantized(tiny_llama_path, dtype=FP16, bits=8)
    card = saved_card(get_peft_model(base, fast_config(adapter_dtype="bf16")), tmp_path)
    code = python_block(card.text)
    assert "load_in_8bit=True" in code and "load_in_4bit" not in code
    assert re.search(r"\| default \| `\.` \| `bf16` \| bf16 \|", card.text)
    assert "8-bit (int8, row-wise scales), compute dtype float16" in card.text
    assert "qlora" in card.data.tags


def test_unquantized_base_card(tiny_llama_path, tmp_path):
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=FP32)
    card = saved_card(get_peft_model(base, fast_config()), tmp_path)
    assert "qlora" not in card.data.tags and "fastlora" in card.data.tags
    assert "BitsAndBytesConfig" not in python_block(card.text)
    assert "Quantization: not quantized (float32)" in card.text
    assert re.search(r"\| default \| `\.` \| `fp32-if-fp16` \| fp32 \|", card.text)


def test_mixed_dtypes_are_listed_per_layer_count(tiny_llama_path, tmp_path):
    """lm_head stays unquantized (fp32 -> fp32 adapter) next to 4-bit bf16-compute layers (-> bf16 adapters)."""
    base = load_quantized(tiny_llama_path, dtype=torch.float32, compute_dtype=BF16)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT: "Setting `save_embedding_layers` to `True`"
        card = saved_card(get_peft_model(base, fast_config(target_modules=targets)), tmp_path)
    assert "| bf16 (14 layers), fp32 (1 layer) |" in card.text


def test_saving_twice_keeps_one_section_and_user_text(tiny_llama_path, tmp_path):
    model = get_peft_model(load_quantized(tiny_llama_path), fast_config())
    model.save_pretrained(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text() + "\n## My notes\n\nTrained on my data.\n")
    model.save_pretrained(tmp_path)
    model.add_adapter("second", fast_config(adapter_dtype="fp32"))
    model.save_pretrained(tmp_path)  # two adapters into the folder that already has a card
    model.save_pretrained(tmp_path)
    card = ModelCard.load(readme)
    assert_one_section(card.text)
    assert card.text.count("## My notes") == 1 and "Trained on my data." in card.text
    assert card.data.tags.count("fastlora") == 1 and card.data.tags.count("qlora") == 1
    assert re.search(r"\| default \| `\.` \| `fp32-if-fp16` \| bf16 \|", card.text)
    assert re.search(r"\| second \| `second` \| `fp32` \| fp32 \|", card.text)
    assert card.text.count("### Framework versions") == 1  # PEFT's own part is not duplicated either
    facts = model_card.read_facts(card.text)
    assert [a["name"] for a in facts["adapters"]] == ["default", "second"]


def test_snippet_runs_and_loads_every_adapter(tiny_llama_path, tmp_path):
    torch.manual_seed(0)
    model = get_peft_model(load_quantized(tiny_llama_path, quant_type="fp4", double_quant=True),
                           fast_config(init_lora_weights=False))
    model.add_adapter("second", fast_config(init_lora_weights=False, adapter_dtype="fp32", r=2))
    model.save_pretrained(tmp_path)
    code = python_block((tmp_path / "README.md").read_text())
    assert code.count(model_card.ADAPTER_PLACEHOLDER) == 1
    scope = {}
    exec(code.replace(model_card.ADAPTER_PLACEHOLDER, str(tmp_path)), scope)  # the README's code, as a user runs it
    loaded = scope["model"]
    assert isinstance(loaded, PeftModel) and set(loaded.peft_config) == {"default", "second"}
    for name in ("default", "second"):
        got, want = (get_peft_model_state_dict(m, adapter_name=name) for m in (loaded, model))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_plain_lora_model_gets_no_fastlora_section(tiny_llama_path, tmp_path):
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
    get_peft_model(load_quantized(tiny_llama_path), fast_config()).save_pretrained(tmp_path)
    assert model_card.BLOCK_START in (tmp_path / "README.md").read_text()
    plain = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    card = saved_card(plain, tmp_path)  # the old FastLoRA section would now be wrong: it goes
    assert model_card.BLOCK_START not in card.text and HEADING not in card.text
    assert "fastlora" not in card.data.tags and "lora" in card.data.tags
    fresh = tmp_path / "fresh"
    card = saved_card(plain, fresh)
    assert model_card.BLOCK_START not in card.text and "fastlora" not in card.data.tags


def test_card_failure_warns_and_still_saves_the_adapter(tiny_llama_path, tmp_path, monkeypatch):
    def broken(_model, _names):
        raise RuntimeError("boom")

    monkeypatch.setattr(model_card, "collect_card_facts", broken)
    model = get_peft_model(load_quantized(tiny_llama_path), fast_config())
    with pytest.warns(UserWarning, match=f"could not update the model card {re.escape(str(tmp_path))}/README.md.*boom"):
        model.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_model.safetensors").is_file()


def valid_facts(**quant_changes) -> dict:
    """Facts as collect_card_facts writes them for a 4-bit nf4 base, with ``quant_changes`` applied."""
    quant = {"method": "bitsandbytes", "bits": 4, "quant_type": "nf4", "compute_dtype": "bfloat16",
             "double_quant": False, "quant_storage": "uint8", "skip_modules": None}
    adapter = {"name": "default", "subfolder": None, "adapter_dtype": "fp32-if-fp16", "dtypes": {"bf16": 14},
               "r": 4, "lora_alpha": 8}
    return {"base_model": "some/base", "model_dtype": "bfloat16", "task_type": "CAUSAL_LM",
            "quantization": {**quant, **quant_changes}, "adapters": [adapter]}


def test_facts_comment_cannot_be_closed_by_a_path():
    facts = {**valid_facts(), "base_model": "models--x/y-->z"}
    comment = model_card._facts_comment(facts)
    assert comment.count("-->") == 1 and comment.endswith("-->")
    assert model_card.read_facts(comment) == facts


def test_only_the_given_adapters_are_described(tiny_llama_path, tmp_path):
    model = get_peft_model(load_quantized(tiny_llama_path), fast_config())
    model.add_adapter("second", fast_config(adapter_dtype="fp32"))
    model.save_pretrained(tmp_path)
    model_card.update_model_card(model, tmp_path, adapter_names=["second"])
    text = (tmp_path / "README.md").read_text()
    assert_one_section(text)
    assert [a["name"] for a in model_card.read_facts(text)["adapters"]] == ["second"]
    assert 'model = PeftModel.from_pretrained(base, adapter, adapter_name="second", subfolder="second")' in text
    assert "AutoPeftModelForCausalLM" not in text  # it would load the default adapter, which this card leaves out


# A crafted facts comment (a card from the Hub) must not become code in a snippet, nor break the Markdown.
PAYLOAD = "bfloat16, __import__('os').system('echo pwned') or torch.float32"
CRAFTED = [
    ({"quantization": {"compute_dtype": PAYLOAD}}, "quantization.compute_dtype"),
    ({"quantization": {"quant_storage": "uint8)\nimport os; os.system('x')\n#"}}, "quantization.quant_storage"),
    ({"quantization": {"double_quant": "__import__('os').system('x')"}}, "quantization.double_quant"),
    ({"quantization": {"double_quant": 1}}, "quantization.double_quant"),
    ({"quantization": {"bits": True}}, "quantization.bits"),
    ({"quantization": {"quant_type": "nf4\"); import os; (\""}}, "quantization.quant_type"),
    ({"quantization": {"method": "x`\n```python\nimport os"}}, "quantization.method"),
    ({"model_dtype": "float32; import os"}, "model_dtype"),
    ({"base_model": "some/base`\n```python"}, "base_model"),
    ({"adapters": [{"name": "default", "subfolder": None, "adapter_dtype": "fp8", "dtypes": {}, "r": 4,
                    "lora_alpha": 8}]}, "adapters[0].adapter_dtype"),
    ({"adapters": []}, "adapters"),
    ({"quantization": {"compute_dtype": None}}, "quantization.compute_dtype"),  # incomplete
]
MISSING = [("facts", lambda f: f.pop("adapters")), ("quantization", lambda f: f["quantization"].pop("double_quant")),
           ("adapters[0]", lambda f: f["adapters"][0].pop("subfolder"))]


@pytest.mark.parametrize("where, drop", MISSING, ids=[m[0] for m in MISSING])
def test_incomplete_facts_are_refused(where, drop):
    facts = valid_facts()
    drop(facts)
    with pytest.raises(model_card.CardFactsError, match=re.escape(f"`{where}` lacks the field(s)")):
        model_card.check_facts(facts)


@pytest.mark.parametrize("change, field", CRAFTED, ids=[c[1] + str(i) for i, c in enumerate(CRAFTED)])
def test_crafted_facts_are_refused(change, field):
    facts = valid_facts(**change.pop("quantization", {}))
    facts.update(change)
    with pytest.raises(model_card.CardFactsError, match=re.escape(f"`{field}` is")):
        model_card.check_facts(facts)
    with pytest.raises(model_card.CardFactsError, match=re.escape(f"`{field}` is")):
        model_card.read_facts(model_card._facts_comment(facts))
    with pytest.raises(model_card.CardFactsError):
        model_card.usage_code(facts, plugin=False)


def test_facts_that_are_not_json_are_refused():
    with pytest.raises(model_card.CardFactsError, match="not valid JSON"):
        model_card.read_facts(model_card.FACTS_PREFIX + "{not json} -->")
    assert model_card.read_facts("no facts here") is None


@pytest.mark.parametrize("storage", model_card.STORAGE_NAMES)
@pytest.mark.parametrize("double_quant", [True, False])
def test_valid_facts_render_as_literals(storage, double_quant):
    """Every allowed value renders as a literal: the snippet compiles, and its names are torch dtypes."""
    code = model_card.usage_code(valid_facts(quant_storage=storage, double_quant=double_quant), plugin=True)
    compile(code, "snippet", "exec")
    assert f"bnb_4bit_quant_storage=torch.{storage}," in code and getattr(torch, storage) is not None
    assert f"bnb_4bit_use_double_quant={double_quant}," in code


def test_install_commands_from_source(monkeypatch):
    """Not on PyPI yet: the card installs from the source URL in the package metadata, or from a checkout."""
    class Meta:
        def __init__(self, urls):
            self.urls = urls

        def get_all(self, key):
            return self.urls if key == "Project-URL" else None

    monkeypatch.setattr(model_card.metadata, "metadata", lambda name: Meta(["Source, https://github.com/o/peft-fastlora"]))
    text = model_card.install_commands()
    assert 'pip install "peft-fastlora @ git+https://github.com/o/peft-fastlora"' in text.splitlines()
    monkeypatch.setattr(model_card.metadata, "metadata", lambda name: Meta(["Source, https://x/$(rm -rf ~)"]))
    assert "git+" not in model_card.install_commands()  # only a plain https URL is rendered
    monkeypatch.setattr(model_card.metadata, "metadata", lambda name: Meta(None))
    lines = model_card.install_commands().splitlines()
    # every line that is not a comment is a command that runs as it is (in the folder holding the checkout)
    assert [line.split("  #")[0] for line in lines if not line.startswith("#")] == ["pip install ./peft-fastlora"]
    assert any("pip install peft-fastlora" in line for line in lines if line.startswith("#"))
