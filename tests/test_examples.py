"""The examples run end to end on CPU: tiny models built in code, no downloads, each script in its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
SCRIPTS = ("train_sft.py", "generate.py", "export_lora.py")


def run_example(script: str, *args: str, cwd: Path, expect_ok: bool = True) -> subprocess.CompletedProcess:
    """Runs ``examples/<script> args`` as a user would (``peft_fastlora`` importable from the repo, HF offline)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    if expect_ok:
        assert proc.returncode == 0, f"{script} {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def adapter_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path / "adapter_model.safetensors", framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}


@pytest.fixture(scope="module")
def sft_adapter(tmp_path_factory) -> Path:
    """An adapter trained for 2 steps by train_sft.py on the tiny model (4-bit NF4, double-quantized, fp32)."""
    out = tmp_path_factory.mktemp("sft")
    proc = run_example("train_sft.py", "--max-steps", "2", "--double-quant", "--output-dir", str(out), cwd=out)
    assert "Final training loss" in proc.stdout
    return out


@pytest.fixture
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script, tmp_path):
    proc = run_example(script, "--help", cwd=tmp_path)
    assert proc.stdout.startswith("usage:")


def test_train_sft_saves_adapter_tokenizer_and_base(sft_adapter):
    config = json.loads((sft_adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "FASTLORA"
    assert config["adapter_dtype"] == "fp32-if-fp16"
    assert Path(config["base_model_name_or_path"]).resolve() == (sft_adapter / "tiny-base").resolve()
    assert (sft_adapter / "tokenizer.json").is_file()
    assert (sft_adapter / "tiny-base" / "config.json").is_file()
    tensors = adapter_tensors(sft_adapter)
    assert tensors and all(t.dtype == torch.float32 for t in tensors.values())  # fp32 compute -> fp32 adapters
    assert any(t.abs().sum() > 0 for name, t in tensors.items() if "lora_B" in name)  # B moved off its zero init


def test_train_sft_8bit_bf16_with_adapter_dtype(tmp_path):
    run_example(
        "train_sft.py", "--8bit", "--bf16", "--adapter-dtype", "fp32", "--r", "4", "--max-steps", "1",
        "--output-dir", str(tmp_path), cwd=tmp_path,
    )  # fmt: skip
    tensors = adapter_tensors(tmp_path)
    assert all(t.dtype == torch.float32 for t in tensors.values())  # the policy wins over the bf16 compute dtype
    assert {t.shape[0] for name, t in tensors.items() if "lora_A" in name} == {4}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only --fp16 error")
def test_train_sft_fp16_on_cpu_is_a_clear_error(examples_on_path, capsys):
    import train_sft

    with pytest.raises(SystemExit) as exit_info:
        train_sft.parse_args(["--fp16"])
    assert exit_info.value.code == 2
    assert "--fp16 needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("merge", [False, True], ids=["adapter", "merged"])
def test_generate_with_train_sft_adapter(sft_adapter, tmp_path, merge):
    args = ["--adapter", str(sft_adapter), "--max-new-tokens", "4", "--prompt", "What is 7 times 8?"]
    proc = run_example("generate.py", *args, *(["--merge"] if merge else []), cwd=tmp_path)
    assert "### Instruction:\nWhat is 7 times 8?\n### Response:\n" in proc.stdout


def test_generate_with_quickstart_adapter(tmp_path):
    if not (EXAMPLES / "quickstart.py").is_file():
        pytest.skip("examples/quickstart.py is not in this checkout")
    adapter = tmp_path / "quickstart-adapter"
    run_example("quickstart.py", "--epochs", "2", "--samples", "8", "--output-dir", str(adapter), cwd=tmp_path)
    proc = run_example(
        "generate.py", "--adapter", str(adapter), "--raw", "--prompt", "the cat sits", "--max-new-tokens", "4",
        cwd=tmp_path,
    )  # fmt: skip
    assert "the cat sits" in proc.stdout


def test_generate_without_adapter_is_a_clear_error(examples_on_path, tmp_path, capsys):
    import generate

    with pytest.raises(SystemExit) as exit_info:
        generate.parse_args(["--adapter", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "has no adapter_config.json" in capsys.readouterr().err


def test_export_lora(sft_adapter, tmp_path):
    from peft import LoraConfig, PeftConfig

    dst = tmp_path / "lora"
    proc = run_example("export_lora.py", str(sft_adapter), str(dst), cwd=tmp_path)
    assert "Exported" in proc.stdout
    config = json.loads((dst / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    assert "adapter_dtype" not in config and "fp16_overflow_guard" not in config
    assert type(PeftConfig.from_pretrained(str(dst))) is LoraConfig
    exported, original = adapter_tensors(dst), adapter_tensors(sft_adapter)
    assert exported.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key


def test_export_lora_refuses_a_non_empty_destination(examples_on_path, sft_adapter, tmp_path):
    import export_lora

    (tmp_path / "keep.txt").write_text("not an adapter")
    with pytest.raises(SystemExit, match="already exists and is not empty") as exit_info:
        export_lora.main([str(sft_adapter), str(tmp_path)])
    assert str(exit_info.value).startswith("export_lora.py: error:")
    export_lora.main([str(sft_adapter), str(tmp_path), "--overwrite"])
    assert json.loads((tmp_path / "adapter_config.json").read_text())["peft_type"] == "LORA"


def test_sample_data_fits_the_tiny_tokenizer(examples_on_path):
    import train_sft

    records = train_sft.load_jsonl(train_sft.DEFAULT_DATA)
    assert 30 <= len(records) <= 60
    tokenizer = train_sft.build_char_tokenizer()
    assert len(tokenizer) <= train_sft.TINY_LLAMA["vocab_size"]
    for record in records:
        example = train_sft.tokenize_example(tokenizer, record, max_length=512)
        assert tokenizer.unk_token_id not in example["input_ids"], record
        n_prompt = sum(label == -100 for label in example["labels"])
        prompt = train_sft.PROMPT_TEMPLATE.format(instruction=record["instruction"])
        assert n_prompt == len(prompt) + 1  # one token per character, plus BOS
        assert example["labels"][-1] == tokenizer.eos_token_id
        assert tokenizer.decode(example["labels"][n_prompt:], skip_special_tokens=True) == record["response"]


def test_collator_pads_and_masks(examples_on_path):
    import train_sft

    batch = train_sft.PadCollator(pad_token_id=0)(
        [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not valid JSON"),
        ('{"instruction": "hi"}', "string fields 'instruction' and 'response'"),
        ('{"instruction": "hi", "response": 3}', "string fields 'instruction' and 'response'"),
    ],
)
def test_load_jsonl_names_the_bad_line(examples_on_path, tmp_path, line, message):
    import train_sft

    path = tmp_path / "data.jsonl"
    path.write_text('{"instruction": "a", "response": "b"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=message) as err:
        train_sft.load_jsonl(path)
    assert f"{path}:3" in str(err.value)
