"""The command line: ``--help`` / ``--version`` without torch, what ``export-lora`` says, and ``merge``."""

import json
import os
import subprocess
import sys
import warnings
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import bitsandbytes as bnb
import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
from transformers import AutoModelForCausalLM, PreTrainedModel

import peft_fastlora
from peft_fastlora.__main__ import main
from tests.utils import load_quantized, save_tiny_llama

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "peft", "bitsandbytes", "triton")
BF16, FP32 = torch.bfloat16, torch.float32


def run(*args, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *args], cwd=kwargs.pop("cwd", REPO), env=env, capture_output=True,
                          text=True, timeout=300, **kwargs)


# ---- --help and --version answer without torch ---------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["export-lora", "--help"], ["merge", "-h"], [],
                                  ["merge", "only-one-arg"]])
def test_python_dash_m_help_and_version_import_no_heavy_module(argv):
    proc = run("-X", "importtime", "-m", "peft_fastlora", *argv)
    usage_error = argv in ([], ["merge", "only-one-arg"])
    assert proc.returncode == (2 if usage_error else 0), proc.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time")}
    assert "peft_fastlora.cli" in imported  # the check below looks at the right process
    assert not {name for name in imported if name.split(".")[0] in HEAVY}
    if argv == ["--version"]:
        assert proc.stdout.strip() == f"peft-fastlora {metadata.version('peft-fastlora')}"
    elif usage_error:
        assert "usage: peft-fastlora" in proc.stderr and "error: the following arguments are required" in proc.stderr
    else:
        assert "usage: peft-fastlora" in proc.stdout


CONSOLE_SCRIPT = """
import atexit, sys
atexit.register(lambda: print("HEAVY:", sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})))
sys.argv = ["/some/venv/bin/peft-fastlora", "--help"]
from peft_fastlora.__main__ import main  # what the installed console script runs
sys.exit(main())
"""


def test_console_script_help_imports_no_heavy_module():
    proc = run("-c", CONSOLE_SCRIPT.format(heavy=set(HEAVY)))
    assert proc.returncode == 0 and "usage: peft-fastlora" in proc.stdout, proc.stderr[-3000:]
    assert "HEAVY: []" in proc.stdout


def test_other_programs_with_help_still_import_the_package():
    """A user's script run with --help imports peft_fastlora normally: only the CLI answers early."""
    script = ("import sys; sys.argv[:] = ['-m', '--help']; import peft_fastlora; "
              "from peft.utils.peft_types import PeftType; print('registered', PeftType.FASTLORA.value)")
    proc = run("-c", script)
    assert proc.returncode == 0 and "registered FASTLORA" in proc.stdout, proc.stderr[-3000:]
    assert "usage:" not in proc.stdout


# ---- export-lora says which adapter it exported -------------------------------------------------------------------
def fast_config(**kwargs) -> peft_fastlora.FastLoraConfig:
    return peft_fastlora.FastLoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": "all-linear",
                                           "task_type": "CAUSAL_LM", "init_lora_weights": False, **kwargs})


@pytest.fixture(scope="module")
def base_path(tmp_path_factory):
    """in_features all multiples of 64: bitsandbytes' CPU path runs the layers that no adapter targets."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-128"), intermediate_size=128)


def test_export_of_a_folder_with_several_adapters_says_which(base_path, tmp_path, capsys):
    model = get_peft_model(load_quantized(base_path), fast_config(target_modules=["q_proj"]))
    model.add_adapter("second", fast_config(target_modules=["v_proj"]))
    model.add_adapter("third", fast_config(target_modules=["v_proj"]))
    model.save_pretrained(tmp_path / "src")
    assert main(["export-lora", str(tmp_path / "src"), str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "Exported the default adapter of" in out
    assert "holds other adapters too: second, third. Export one with `--subfolder NAME`." in out
    assert main(["export-lora", str(tmp_path / "src"), str(tmp_path / "b"), "--subfolder", "third"]) == 0
    out = capsys.readouterr().out
    assert "the adapter in the subfolder 'third'" in out
    assert "the default one (no --subfolder), second" in out
    model.save_pretrained(tmp_path / "one", selected_adapters=["default"])
    assert main(["export-lora", str(tmp_path / "one"), str(tmp_path / "c")]) == 0
    assert "other adapters" not in capsys.readouterr().out


# ---- merge -----------------------------------------------------------------------------------------------------------
def ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def logits(model) -> torch.Tensor:
    return model(input_ids=ids().to(next(model.parameters()).device)).logits.float().cpu()


def trained(base_path, folder: Path, targets, dtype=BF16, compute_dtype=BF16) -> SimpleNamespace:
    """A FastLoRA adapter (random, non-zero B) on the 4-bit nf4 base, saved to ``folder``, and its model."""
    torch.manual_seed(0)
    model = get_peft_model(load_quantized(base_path, dtype=dtype, compute_dtype=compute_dtype),
                           fast_config(target_modules=targets))
    model.save_pretrained(folder)
    return SimpleNamespace(path=folder, model=model.eval())


def load_merged(path: Path):
    merged = AutoModelForCausalLM.from_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert not [m for m in merged.modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))]
    assert {p.name for p in path.iterdir()} == {"config.json", "generation_config.json", "model.safetensors"}
    return merged


def test_merge_with_fp32_compute_is_lossless(base_path, tmp_path, capsys):
    """fp32 compute and fp32 output: nothing is rounded to 16 bits on either side, so the merged model computes what
    the adapter model computes up to fp32 summation order (measured 8e-7 on logits of size ~0.6)."""
    adapter = trained(base_path, tmp_path / "adapter", "all-linear", dtype=FP32, compute_dtype=FP32)
    assert main(["merge", str(base_path), str(adapter.path), str(tmp_path / "fp16")]) == 0
    assert load_merged(tmp_path / "fp16").dtype == BF16  # 16-bit by default, even from an fp32 model
    assert main(["merge", str(base_path), str(adapter.path), str(tmp_path / "merged"), "--dtype", "float32"]) == 0
    assert "Wrote a plain checkpoint" in capsys.readouterr().out
    merged = load_merged(tmp_path / "merged")
    assert merged.dtype == FP32
    with adapter.model.disable_adapter():
        base_logits = logits(adapter.model)
    expected = logits(adapter.model)
    assert (expected - base_logits).abs().max() > 0.1  # the adapter matters
    torch.testing.assert_close(logits(merged), expected, atol=1e-5, rtol=0)


def test_merge_in_bf16_matches_the_adapter_model(base_path, tmp_path):
    """The default: the card's bf16 model dtype. The adapter model rounds x @ W and the LoRA term to bf16 separately
    and adds them; the merged one rounds W + delta to bf16 once and computes x @ W' in bf16. Each is within a bf16
    rounding per op of the same function, through 2 decoder layers: measured 0.022 on logits of size ~0.6 (bf16's
    spacing there is 2**-8 = 0.004); 0.05 allows that with margin and is far below the adapter's own effect (> 0.1)."""
    adapter = trained(base_path, tmp_path / "adapter", "all-linear")
    assert main(["merge", str(base_path), str(adapter.path), str(tmp_path / "merged")]) == 0
    merged = load_merged(tmp_path / "merged")
    assert merged.dtype == BF16
    with adapter.model.disable_adapter():
        base_logits = logits(adapter.model)
    expected = logits(adapter.model)
    assert (expected - base_logits).abs().max() > 0.1
    torch.testing.assert_close(logits(merged), expected, atol=5e-2, rtol=0)


def test_merge_of_a_partial_adapter_dequantizes_every_layer_exactly(base_path, tmp_path):
    """Layers the adapter does not target are dequantized too: a plain checkpoint, each weight exactly
    dequant(W) (+ scaling * B @ A where targeted), rounded once to the output dtype."""
    adapter = trained(base_path, tmp_path / "adapter", ["q_proj", "v_proj"], dtype=FP32, compute_dtype=FP32)
    assert main(["merge", str(base_path), str(adapter.path), str(tmp_path / "merged"), "--dtype", "float32"]) == 0
    load_merged(tmp_path / "merged")
    quantized = load_quantized(base_path, dtype=FP32, compute_dtype=FP32)  # the same deterministic quantization
    with safe_open(tmp_path / "merged" / "model.safetensors", "pt") as saved:
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            key = f"model.layers.1.self_attn.{proj}.weight"
            layer = quantized.get_submodule(key.removesuffix(".weight"))
            want = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
            if proj in ("q_proj", "v_proj"):
                lora = adapter.model.base_model.model.get_submodule(key.removesuffix(".weight"))
                want = want + lora.get_delta_weight("default")
            torch.testing.assert_close(saved.get_tensor(key), want, atol=1e-6, rtol=1e-6, msg=key)


def test_merge_refuses_destinations_it_would_damage(base_path, tmp_path, capsys):
    adapter = trained(base_path, tmp_path / "adapter", ["q_proj"])
    before = {p.name: p.read_bytes() for p in adapter.path.iterdir()}
    for dst, message in ((adapter.path, "is, contains or lies inside"),
                         (adapter.path / "merged", "is, contains or lies inside"),
                         (base_path, "is, contains or lies inside")):
        assert main(["merge", str(base_path), str(adapter.path), str(dst), "--overwrite"]) == 1
        assert message in capsys.readouterr().err
    other = trained(base_path, tmp_path / "other-adapter", ["v_proj"])
    assert main(["merge", str(base_path), str(adapter.path), str(other.path), "--overwrite"]) == 1
    assert "holds an adapter, which `overwrite` does not replace" in capsys.readouterr().err
    assert main(["merge", str(base_path), str(tmp_path / "typo"), str(tmp_path / "new")]) == 1
    assert "`adapter_dir` " in capsys.readouterr().err and not (tmp_path / "new").exists()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    assert main(["merge", str(base_path), str(adapter.path), str(tmp_path / "busy")]) == 1
    assert "already exists and is not empty" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in adapter.path.iterdir()} == before


def test_merge_failure_keeps_the_previous_checkpoint_and_overwrite_drops_stale_shards(base_path, tmp_path,
                                                                                     monkeypatch):
    adapter = trained(base_path, tmp_path / "adapter", ["q_proj"])
    dst = tmp_path / "merged"
    assert main(["merge", str(base_path), str(adapter.path), str(dst)]) == 0
    (dst / "model-00002-of-00002.safetensors").write_bytes(b"a stale shard of an earlier, sharded save")
    (dst / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    original = PreTrainedModel.save_pretrained

    def full_disk(self, save_directory, *args, **kwargs):
        original(self, save_directory, *args, **kwargs)
        (Path(save_directory) / "model.safetensors").write_bytes(b"\0" * 10)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full_disk)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["merge", str(base_path), str(adapter.path), str(dst), "--overwrite"]) == 1
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if ".peft-fastlora-tmp-" in p.name]
    monkeypatch.undo()
    assert main(["merge", str(base_path), str(adapter.path), str(dst), "--overwrite"]) == 0
    assert not (dst / "model-00002-of-00002.safetensors").exists() and (dst / "notes.txt").read_text() == "mine"
    load_merged_names = {p.name for p in dst.iterdir()} - {"notes.txt"}
    assert load_merged_names == {"config.json", "generation_config.json", "model.safetensors"}


def test_merge_of_a_plain_lora_adapter(base_path, tmp_path):
    """A stock PEFT LoRA adapter (no FastLoRA card) merges onto the base as its checkpoint stores it."""
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_path, dtype=FP32),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    model.save_pretrained(tmp_path / "lora")
    assert main(["merge", str(base_path), str(tmp_path / "lora"), str(tmp_path / "merged"), "--dtype", "float32"]) == 0
    merged = load_merged(tmp_path / "merged")
    expected = logits(model.eval())
    with model.disable_adapter():
        assert (expected - logits(model)).abs().max() > 0.1
    torch.testing.assert_close(logits(merged), expected, atol=1e-5, rtol=0)


@pytest.mark.gpu
def test_merge_on_cuda_matches_the_adapter_model(base_path, tmp_path):
    """The same merge on the GPU (--device cuda:0): the adapter model runs FastLoRA's Triton kernels, the merged one
    cuBLAS; both are within bf16 roundings of the same function (the tolerance of the CPU bf16 test)."""
    adapter = trained(base_path, tmp_path / "adapter", "all-linear")
    adapter.model.to("cuda")
    assert main(["merge", str(base_path), str(adapter.path), str(tmp_path / "merged"), "--device", "cuda:0"]) == 0
    merged = load_merged(tmp_path / "merged").to("cuda")
    with adapter.model.disable_adapter():
        base_logits = logits(adapter.model)
    expected = logits(adapter.model)
    assert (expected - base_logits).abs().max() > 0.1
    torch.testing.assert_close(logits(merged), expected, atol=5e-2, rtol=0)
