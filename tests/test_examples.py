"""The examples run end to end on CPU: tiny models built in code, no downloads, each script in its own process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
SCRIPTS = ("quickstart.py", "train_sft.py", "generate.py", "export_lora.py")


def run_example(
    script: str, *args: str, cwd: Path, expect_ok: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Runs ``examples/<script> args`` as a user would (``peft_fastlora`` importable from the repo, HF offline)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
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
def sft_adapter_8bit(tmp_path_factory) -> Path:
    """An adapter trained for 1 step by train_sft.py on the tiny model, 8-bit."""
    out = tmp_path_factory.mktemp("sft8")
    run_example("train_sft.py", "--8bit", "--max-steps", "1", "--output-dir", str(out), cwd=out)
    return out


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


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script, tmp_path):
    proc = run_example(script, "--help", cwd=tmp_path)
    assert proc.stdout.startswith("usage:")


@pytest.mark.slow
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


@pytest.mark.slow
def test_train_sft_8bit_bf16_with_adapter_dtype(tmp_path):
    run_example(
        "train_sft.py", "--8bit", "--bf16", "--adapter-dtype", "fp32", "--r", "4", "--max-steps", "1",
        "--output-dir", str(tmp_path), cwd=tmp_path,
    )  # fmt: skip
    tensors = adapter_tensors(tmp_path)
    assert all(t.dtype == torch.float32 for t in tensors.values())  # the policy wins over the bf16 compute dtype
    assert {t.shape[0] for name, t in tensors.items() if "lora_A" in name} == {4}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks --fp16 on a CPU-only machine")
def test_train_sft_accepts_fp16_on_cpu_with_a_note(examples_on_path, capsys):
    """The Trainer runs fp16 on a CPU (slowly): the script says so instead of refusing."""
    import train_sft

    args = train_sft.parse_args(["--fp16"])
    assert args.fp16
    out = capsys.readouterr().out
    assert "--fp16 on a CPU runs, slowly" in out
    assert "no fp16 mode" not in (EXAMPLES / "train_sft.py").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("merge", [False, True], ids=["adapter", "merged"])
def test_generate_with_train_sft_adapter(sft_adapter, tmp_path, merge):
    args = ["--adapter", str(sft_adapter), "--max-new-tokens", "4", "--prompt", "What is 7 times 8?"]
    proc = run_example("generate.py", *args, *(["--merge"] if merge else []), cwd=tmp_path)
    assert "### Instruction:\nWhat is 7 times 8?\n### Response:\n" in proc.stdout


@pytest.mark.slow
def test_generate_graphed_gives_the_same_text(sft_adapter, tmp_path):
    args = ["--adapter", str(sft_adapter), "--max-new-tokens", "6", "--prompt", "What is 7 times 8?"]
    plain = run_example("generate.py", *args, cwd=tmp_path)
    graphed = run_example("generate.py", *args, "--graphed", cwd=tmp_path)
    assert graphed.stdout == plain.stdout and "### Response:\n" in plain.stdout


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


# ---- quickstart.py: reads like a CLI ---------------------------------------------------------------------------
THIRD_PARTY_NOISE = ("Failed to load CPU gemm_4bit_forward", "Loading weights", "Writing model shards", "Warning")


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """quickstart.py with its default (temporary) output, TMPDIR pointed at an empty folder to see what it leaves."""
    tmp = tmp_path_factory.mktemp("quickstart-tmp")
    cwd = tmp_path_factory.mktemp("quickstart-cwd")
    proc = run_example("quickstart.py", "--epochs", "2", "--samples", "16", cwd=cwd, env={"TMPDIR": str(tmp)})
    return proc, tmp


@pytest.mark.slow
def test_quickstart_prints_only_its_own_lines(quickstart_run):
    proc, _ = quickstart_run
    for noise in THIRD_PARTY_NOISE:
        assert noise not in proc.stdout + proc.stderr, noise
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["Base model", "Adapter"]
    assert sum(line.startswith("Loss:") for line in lines) == 1  # the per-step losses are in the progress bar
    assert "loss=" in proc.stderr and "Training" in proc.stderr
    assert "trainable params:" not in proc.stdout  # PEFT's print_trainable_parameters line is folded into ours


@pytest.mark.slow
def test_quickstart_removes_its_temp_folder_and_says_what_next(quickstart_run):
    proc, tmp = quickstart_run
    (saved,) = re.findall(r"^Saved: +(\S+) \(a temporary folder", proc.stdout, re.MULTILINE)
    assert Path(saved).parent == tmp and not Path(saved).exists()
    assert not list(tmp.glob("fastlora-*"))  # (torch may leave its own compile cache there)
    tail = proc.stdout.splitlines()[-4:]
    assert tail[0] == "Next:" and "--output-dir DIR" in tail[1] and "train_sft.py --help" in tail[2]
    assert "deleted" in proc.stdout


@pytest.mark.slow
def test_quickstart_output_dir_keeps_a_loadable_adapter(tmp_path):
    out = tmp_path / "run"
    proc = run_example("quickstart.py", "--epochs", "1", "--samples", "8", "--output-dir", str(out), cwd=tmp_path)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "FASTLORA"
    assert Path(config["base_model_name_or_path"]).resolve() == (out / "tiny-base").resolve()
    assert "generate.py --adapter run --raw" in proc.stdout  # the hint names the folder as typed from the cwd


def test_quickstart_refuses_a_non_empty_output_dir(examples_on_path, tmp_path, capsys):
    import quickstart

    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        quickstart.parse_args(["--output-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "already exists and is not empty" in capsys.readouterr().err


def test_quiet_drops_only_the_known_bitsandbytes_line(examples_on_path, caplog):
    import logging

    import quiet

    quiet.quiet_third_party()
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s.", "No module named 'kernels'")
        logger.warning("Some other bitsandbytes warning")
    assert [r.getMessage() for r in caplog.records] == ["Some other bitsandbytes warning"]


# ---- generate.py: loads the base model as the card records -----------------------------------------------------
def generate_args(generate, adapter: Path, *flags: str):
    return generate.parse_args(["--adapter", str(adapter), *flags])


@pytest.mark.slow
def test_generate_loads_an_8bit_adapter_on_an_8bit_base(examples_on_path, sft_adapter_8bit):
    import generate

    from peft_fastlora.layer import FastLoraLayer

    model = generate.load_model(generate_args(generate, sft_adapter_8bit))
    layers = [m for m in model.modules() if isinstance(m, FastLoraLayer)]
    assert layers and all(type(m).__name__ == "FastLoraLinear8bit" for m in layers)


@pytest.mark.slow
def test_generate_rebuilds_4bit_double_quant_from_the_card(examples_on_path, sft_adapter):
    import bitsandbytes as bnb
    import generate

    model = generate.load_model(generate_args(generate, sft_adapter))
    bases = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert bases and all(m.weight.quant_state.nested for m in bases)  # train_sft ran with --double-quant
    assert {m.weight.quant_state.quant_type for m in bases} == {"nf4"}


def card(quantization: dict | None, model_dtype: str = "float32") -> dict:
    return {"quantization": quantization, "model_dtype": model_dtype, "adapters": []}


NF4_BF16 = {"method": "bitsandbytes", "bits": 4, "quant_type": "fp4", "compute_dtype": "bfloat16",
            "double_quant": True, "quant_storage": "uint8", "skip_modules": None}  # fmt: skip


@pytest.mark.parametrize(
    "facts, flags, expected, said",
    [
        (card({"method": "bitsandbytes", "bits": 8, "skip_modules": ["lm_head"]}), [],
         {"load_in_8bit": True, "llm_int8_skip_modules": ["lm_head"]}, "8-bit, float32 (as its model card records)"),
        (card(NF4_BF16, "bfloat16"), [],
         {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4", "bnb_4bit_use_double_quant": True,
          "bnb_4bit_compute_dtype": "bfloat16", "dtype": "bfloat16"}, "4-bit fp4, double quantization, bfloat16"),
        (card(NF4_BF16, "bfloat16"), ["--quant-type", "nf4", "--no-double-quant", "--fp16"],
         {"bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": False, "bnb_4bit_compute_dtype": "float16",
          "dtype": "float16"}, "4-bit nf4, float16 compute"),
        (card(NF4_BF16), ["--8bit"], {"load_in_8bit": True, "load_in_4bit": False},
         "--8bit; the adapter was trained on a 4-bit base"),
        (None, [], {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": False},
         "no FastLoRA model card"),
        (card(None), [], {"quantization_config": None, "dtype": "float32"}, "not quantized, float32"),
    ],
    ids=["8bit-card", "4bit-card", "flags-override", "8bit-flag", "no-card", "unquantized-card"],
)  # fmt: skip
def test_generate_base_loading(examples_on_path, tmp_path, facts, flags, expected, said):
    import generate

    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "some/model"}))
    kwargs, how = generate.base_loading(generate_args(generate, tmp_path, *flags), facts)
    quant = kwargs.get("quantization_config")
    seen = {"dtype": str(kwargs["dtype"]).removeprefix("torch."), "quantization_config": quant}
    if quant is not None:
        seen.update({key: getattr(quant, key) for key in expected if hasattr(quant, key)})
        seen["bnb_4bit_compute_dtype"] = str(quant.bnb_4bit_compute_dtype).removeprefix("torch.")
    for key, value in expected.items():
        assert seen[key] == value, (key, how)
    assert said in how


def test_generate_reads_the_facts_of_a_saved_card(examples_on_path, tmp_path):
    import generate

    from peft_fastlora.model_card import write_fastlora_card

    facts = card({"method": "bitsandbytes", "bits": 8, "skip_modules": None})
    facts.update(base_model="some/model", task_type="CAUSAL_LM", adapters=[
        {"name": "default", "subfolder": None, "adapter_dtype": "fp32-if-fp16", "dtypes": {"fp32": 2}, "r": 4,
         "lora_alpha": 8}])  # fmt: skip
    write_fastlora_card(tmp_path / "README.md", facts)
    assert generate.card_facts(tmp_path)["quantization"]["bits"] == 8
    assert generate.card_facts(tmp_path / "missing") is None


@pytest.mark.parametrize("flags", [["--8bit", "--double-quant"], ["--8bit", "--quant-type", "fp4"]])
def test_generate_rejects_4bit_options_with_8bit(examples_on_path, tmp_path, capsys, flags):
    import generate

    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "some/model"}))
    with pytest.raises(SystemExit) as exit_info:
        generate_args(generate, tmp_path, *flags)
    assert exit_info.value.code == 2
    assert "applies to 4-bit weights only" in capsys.readouterr().err


# ---- train_sft.py: data and arguments are checked up front -----------------------------------------------------
GOOD_LINE = '{"instruction": "a", "response": "b"}\n'


@pytest.mark.parametrize(
    "bad_line, message",
    [
        (b'["instruction", "response"]\n', "needs a JSON object"),
        (b'"just a string"\n', "needs a JSON object"),
        (b"42\n", "needs a JSON object"),
        (b'{"instruction": "caf\xe9", "response": "b"}\n', "not valid UTF-8 (byte 0xe9"),
    ],
    ids=["list", "string", "number", "latin-1"],
)
def test_read_jsonl_names_file_and_line(examples_on_path, tmp_path, bad_line, message):
    import train_sft

    path = tmp_path / "data.jsonl"
    path.write_bytes(GOOD_LINE.encode() + b"\n" + bad_line)
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        train_sft.read_jsonl(path)
    assert str(err.value).startswith(f"{path}:3: ")


def test_read_jsonl_keeps_line_numbers(examples_on_path, tmp_path):
    import train_sft

    path = tmp_path / "data.jsonl"
    path.write_text(GOOD_LINE + "\n" + GOOD_LINE.replace('"b"', '"c"'), encoding="utf-8")
    assert [(n, r["response"]) for n, r in train_sft.read_jsonl(path)] == [(1, "b"), (3, "c")]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-length", "0"], "--max-length must be a positive integer, got 0"),
        (["--max-steps", "-1"], "--max-steps must be a positive integer"),
        (["--batch-size", "0"], "--batch-size must be a positive integer"),
        (["--lr", "0"], "--lr must be a positive number"),
        (["--8bit", "--double-quant"], "--double-quant applies to 4-bit weights only"),
        (["--8bit", "--quant-type", "fp4"], "--quant-type fp4 applies to 4-bit weights only"),
        (["--model", "./no/such/model"], "--model './no/such/model': no such file or folder"),
        (["--model", "/no/such/model"], "no such file or folder"),
    ],
)
def test_train_sft_rejects_bad_arguments_up_front(examples_on_path, capsys, flags, message):
    import train_sft

    with pytest.raises(SystemExit) as exit_info:
        train_sft.parse_args(flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Repo id" not in err


def test_train_sft_rejects_a_model_folder_without_config(examples_on_path, tmp_path, capsys):
    import train_sft

    with pytest.raises(SystemExit):
        train_sft.parse_args(["--model", str(tmp_path)])
    assert "without a config.json" in capsys.readouterr().err


def test_train_sft_reports_bad_data_before_loading_a_model(examples_on_path, tmp_path):
    import train_sft

    data = tmp_path / "data.jsonl"
    data.write_text(GOOD_LINE + "[1, 2]\n", encoding="utf-8")
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=re.escape(f"train_sft.py: error: --data: {data}:2: ")):
        train_sft.main(["--data", str(data), "--output-dir", str(out)])
    assert not out.exists()  # nothing built, nothing saved


def test_train_sft_refuses_data_with_no_response_within_max_length(examples_on_path, tmp_path):
    import train_sft

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as err:
        train_sft.main(["--max-length", "10", "--output-dir", str(out)])
    message = str(err.value)
    assert f"{train_sft.DEFAULT_DATA}:1: the prompt of every example is at least --max-length 10" in message
    assert re.search(r"use --max-length \d+ or more", message)
    assert not out.exists()  # no adapter trained on nothing


def test_build_train_data_leaves_out_examples_without_a_response_token(examples_on_path, capsys):
    import train_sft

    tokenizer = train_sft.build_char_tokenizer()
    short = {"instruction": "hi", "response": "yes"}
    long = {"instruction": "x" * 200, "response": "no"}
    prompt_len = len(train_sft.PROMPT_TEMPLATE.format(instruction="hi")) + 1  # + BOS
    data = train_sft.build_train_data(tokenizer, [(1, short), (2, long), (5, long)], prompt_len + 2, Path("d.jsonl"))
    assert len(data) == 1 and data[0]["labels"][-2:] != [-100, -100]
    out = capsys.readouterr().out
    assert "Left out 2 of 3 examples" in out and "d.jsonl lines 2, 5" in out


# ---- documented commands stay out of the repository ------------------------------------------------------------
def test_documented_example_commands_write_outside_the_repo():
    docs = (REPO / "docs" / "index.md").read_text(encoding="utf-8")
    block = docs.split("## Examples", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line.startswith("python examples/")]
    assert len(commands) == 3
    assert all("$OUT/" in line and "outputs/" not in line for line in commands)
    for script in EXAMPLES.glob("*.py"):
        text = script.read_text(encoding="utf-8")
        assert "--output-dir outputs" not in text and "--adapter outputs" not in text, script.name
    assert "/outputs/" in (REPO / ".gitignore").read_text().splitlines()
