"""Plain-LoRA interop: ``export_lora`` / ``peft-fastlora export-lora`` and ``load_lora_as_fastlora``.

The export is loaded by stock PEFT in a subprocess that cannot import peft_fastlora at all.
"""

import json
import os
import shutil
import subprocess
import sys
import warnings
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from huggingface_hub import ModelCard
from peft import IA3Config, LoraConfig, get_peft_model
from peft.tuners.lora import Linear as PeftLoraLinear
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

import peft_fastlora
from peft_fastlora import export_lora, load_lora_as_fastlora, model_card
from peft_fastlora.__main__ import main
from peft_fastlora.bnb import FastLoraLinear4bit
from peft_fastlora.export import FASTLORA_ONLY_FIELDS, fastlora_config_from_lora
from tests.utils import save_tiny_llama

REPO = Path(__file__).resolve().parents[1]
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
WEIGHTS = "adapter_model.safetensors"
# name -> (BitsAndBytesConfig kwargs with dtype names, or None; model dtype name)
CASES = {
    "nf4-bf16": ({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "bfloat16"},
                 "bfloat16"),
    "fp4-fp16-dq": ({"load_in_4bit": True, "bnb_4bit_quant_type": "fp4", "bnb_4bit_compute_dtype": "float16",
                     "bnb_4bit_use_double_quant": True}, "float16"),
    "int8-fp16": ({"load_in_8bit": True}, "float16"),
    "unquantized-fp32": (None, "float32"),
}
# Stock PEFT computes what FastLoRA computes, in another order and with other roundings: bitsandbytes' CPU inference
# path repacks 4-bit weights for its own kernel and rounds absmax to bf16 on the way (on CUDA its kernels differ from
# ours in summation order), and stock PEFT upcasts bf16 adapters to fp32 and runs the LoRA branch in fp32 where FastLoRA
# keeps the policy's dtype. Each is one extra rounding of a 16-bit intermediate, which moves the 16-bit logits (about
# 0.5 in size here) by a few of their ulps (bf16: 2**-8 at 0.5), far below the adapter's own effect (checked > 0.1).
# bnb's 8-bit layers (LLM.int8) also quantize the activations to int8, which FastLoRA's weight-only int8 does not:
# one more rounding, of the inputs, at int8 precision. The unquantized fp32 case runs the same PEFT layers on both
# sides: only summation order may differ. Measured on CPU: 0.0098 (bf16), 0.0024 (fp4 fp16), 0.0088 (int8), 0.
ATOL = {"nf4-bf16": 3e-2, "nf4-bf16-second": 3e-2, "fp4-fp16-dq": 1e-2, "int8-fp16": 4e-2, "unquantized-fp32": 1e-5}
MIN_ADAPTER_EFFECT = 0.1

STOCK_PEFT_SCRIPT = r"""
import json, sys
sys.modules["peft_fastlora"] = None  # importing the plugin now fails: this process runs stock PEFT only
import torch
from peft import PeftModel
from peft.utils import get_peft_model_state_dict
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

spec = json.loads(open(sys.argv[1]).read())
results = {}
for case in spec["cases"]:
    kwargs = {"dtype": getattr(torch, case["dtype"])}
    if case["quant"]:
        quant = {k: getattr(torch, v) if k.endswith("_dtype") else v for k, v in case["quant"].items()}
        kwargs["quantization_config"] = BitsAndBytesConfig(**quant)
    kwargs["device_map"] = {"": case["device"]}
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(case["base"], **kwargs), case["adapter"])
    with torch.no_grad():
        logits = model(input_ids=torch.load(case["ids"]).to(case["device"])).logits.cpu()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    results[case["name"]] = {
        "logits": logits,
        "state": {k: v.cpu() for k, v in get_peft_model_state_dict(model).items()},
        "peft_type": model.peft_config["default"].peft_type.value,
        "layer": type(layer).__module__ + "." + type(layer).__name__,
    }
# the export's README code runs as it is (the placeholder aside), with stock PEFT
code = open(spec["readme"]).read().split("```python\n")[1].split("```")[0]
scope = {}
exec(code.replace("path/to/this/adapter", spec["readme_adapter"]), scope)
results["readme_peft_type"] = scope["model"].peft_config["default"].peft_type.value
assert not [m for m in sys.modules if m.startswith("peft_fastlora") and sys.modules[m] is not None]
torch.save(results, spec["out"])
"""


def fast_config(**kwargs):
    return peft_fastlora.FastLoraConfig(
        **{"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "task_type": "CAUSAL_LM",
           "init_lora_weights": False, **kwargs}
    )


def load_base(path, case: str, device: str = "cpu"):
    quant, dtype = CASES[case]
    kwargs = {"dtype": getattr(torch, dtype)}
    if quant:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            **{k: getattr(torch, v) if k.endswith("_dtype") else v for k, v in quant.items()}
        )
    # an explicit device_map: without one, transformers puts a bitsandbytes model on the GPU when there is one
    return AutoModelForCausalLM.from_pretrained(path, device_map={"": device}, **kwargs)


def tokens(rows: int = 2, seq: int = 6) -> torch.Tensor:
    return torch.randint(0, 128, (rows, seq), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def logits(model, device: str = "cpu") -> torch.Tensor:
    return model(input_ids=tokens().to(device)).logits.cpu()


def adapter_tensors(model, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in get_peft_model_state_dict(model, adapter_name=adapter_name).items()}


@pytest.fixture(scope="module")
def base_path(tmp_path_factory):
    """A tiny Llama whose in_features are all multiples of 64: bitsandbytes' CPU inference path (which stock PEFT
    uses) fails on a 4-bit layer whose in_features is not a multiple of the blocksize (e.g. down_proj's 96)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-128"), intermediate_size=128)


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def exported(request, base_path, tmp_path_factory):
    """Every case saved by FastLoRA, exported, then loaded by stock PEFT in a subprocess without peft_fastlora."""
    device = request.param
    root = tmp_path_factory.mktemp(f"export-{device}")
    ids = root / "ids.pt"
    torch.save(tokens(), ids)
    torch.manual_seed(0)
    cases, fast = [], {}
    for name in CASES:
        model = get_peft_model(load_base(base_path, name, device), fast_config())
        saved = root / name / "fastlora"
        exports = {name: (None, "default")}
        if name == "nf4-bf16":  # also a second adapter, saved in a subfolder, exported on its own
            model.add_adapter("second", fast_config(r=2, adapter_dtype="fp32", target_modules=["q_proj", "o_proj"]))
            exports[f"{name}-second"] = ("second", "second")
        model.save_pretrained(saved)
        for case, (subfolder, adapter) in exports.items():
            path = export_lora(saved, root / case / "lora", subfolder=subfolder)
            model.set_adapter(adapter)
            with model.disable_adapter():
                base_logits = logits(model, device)
            fast[case] = SimpleNamespace(logits=logits(model, device), base_logits=base_logits, path=path,
                                         source=saved / subfolder if subfolder else saved)
            cases.append({"name": case, "base": str(base_path), "quant": CASES[name][0], "dtype": CASES[name][1],
                          "device": device, "adapter": str(path), "ids": str(ids)})
    spec = root / "spec.json"
    readme = {"readme": str(fast["nf4-bf16"].path / "README.md"), "readme_adapter": str(fast["nf4-bf16"].path)}
    spec.write_text(json.dumps({"cases": cases, "out": str(root / "stock.pt"), **readme}))
    # Drop the repo root from PYTHONPATH (other entries, e.g. where bitsandbytes lives, stay); the script also
    # poisons sys.modules["peft_fastlora"], so the plugin cannot be imported there whatever the path.
    repo = str(Path(__file__).resolve().parents[1])
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != Path(repo)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.run([sys.executable, "-c", STOCK_PEFT_SCRIPT, str(spec)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return SimpleNamespace(fast=fast, stock=torch.load(root / "stock.pt"), device=device)


# ---- the exported folder -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["nf4-bf16", "nf4-bf16-second"])
def test_export_files(exported, case):
    out, source = exported.fast[case].path, exported.fast[case].source
    assert {p.name for p in out.iterdir()} == {"adapter_config.json", WEIGHTS, "README.md"}
    assert (out / WEIGHTS).read_bytes() == (source / WEIGHTS).read_bytes()
    src_config = json.loads((source / "adapter_config.json").read_text())
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and src_config["peft_type"] == "FASTLORA"
    assert set(FASTLORA_ONLY_FIELDS) == {"adapter_dtype", "fp16_overflow_guard"}
    assert not set(FASTLORA_ONLY_FIELDS) & set(config)
    assert config == {k: v for k, v in src_config.items() if k not in FASTLORA_ONLY_FIELDS} | {"peft_type": "LORA"}
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "peft" and "lora" in card.data.tags and "fastlora" not in card.data.tags
    assert card.text.count("## Using this adapter") == 1
    assert "import peft_fastlora" not in card.text and "BitsAndBytesConfig(" in card.text
    assert exported.stock["readme_peft_type"] == "LORA"  # its code ran in the stock-PEFT subprocess


@pytest.mark.parametrize("case", list(CASES) + ["nf4-bf16-second"])
def test_stock_peft_loads_export(exported, case):
    stock, fast = exported.stock[case], exported.fast[case]
    assert stock["peft_type"] == "LORA"
    expected_layer = {"int8-fp16": "peft.tuners.lora.bnb.Linear8bitLt",
                      "unquantized-fp32": "peft.tuners.lora.layer.Linear"}
    assert stock["layer"] == expected_layer.get(case, "peft.tuners.lora.bnb.Linear4bit")
    saved = load_file(fast.path / WEIGHTS)
    assert stock["state"].keys() == saved.keys()
    for key, value in saved.items():  # stock PEFT upcasts 16-bit adapters to fp32: exact, so the values are equal
        assert torch.equal(stock["state"][key], value.to(stock["state"][key].dtype)), key
    assert (fast.logits - fast.base_logits).float().abs().max() > MIN_ADAPTER_EFFECT
    torch.testing.assert_close(stock["logits"].float(), fast.logits.float(), atol=ATOL[case], rtol=0)


# ---- errors --------------------------------------------------------------------------------------------------------
def test_export_errors(exported, tmp_path):
    fastlora_dir = exported.fast["nf4-bf16"].source
    with pytest.raises(FileNotFoundError, match="`src_dir` .*missing.* is not a folder"):
        export_lora(tmp_path / "missing", tmp_path / "out")
    with pytest.raises(ValueError, match="not a FastLoRA adapter: .*peft_type 'LORA'.*nothing to export"):
        export_lora(exported.fast["nf4-bf16"].path, tmp_path / "out")
    holder = tmp_path / "holder"  # a folder with adapters in subfolders only
    shutil.copytree(fastlora_dir / "second", holder / "second")
    with pytest.raises(FileNotFoundError, match=r"has no adapter_config.json. .*\['second'\].*--subfolder"):
        export_lora(holder, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="`subfolder` 'nope'"):
        export_lora(fastlora_dir, tmp_path / "out", subfolder="nope")
    with pytest.raises(ValueError, match="adapter's own folder"):
        export_lora(fastlora_dir, fastlora_dir, overwrite=True)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "adapter_model.bin").write_bytes(b"stale")
    with pytest.raises(FileExistsError, match="already exists and is not empty.*--overwrite"):
        export_lora(fastlora_dir, taken)
    export_lora(fastlora_dir, taken, overwrite=True)
    assert not (taken / "adapter_model.bin").exists()  # a stale weight file must not shadow the new one
    assert (taken / WEIGHTS).read_bytes() == (fastlora_dir / WEIGHTS).read_bytes()
    (tmp_path / "empty").mkdir()
    assert export_lora(fastlora_dir, tmp_path / "empty") == tmp_path / "empty"  # an empty folder is fine


def test_export_without_a_readme(exported, tmp_path):
    """An adapter folder without README.md (copied by hand, say) still gets a valid card from its config."""
    source = exported.fast["nf4-bf16"].source
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("adapter_config.json", WEIGHTS):
        shutil.copyfile(source / name, bare / name)
    card = ModelCard.load(export_lora(bare, tmp_path / "out") / "README.md")
    base = json.loads((source / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert card.data.base_model == base and card.data.library_name == "peft"
    assert {"lora", f"base_model:adapter:{base}"} <= set(card.data.tags)
    assert card.text.count("## Using this adapter") == 1 and "PeftModel.from_pretrained(base, adapter)" in card.text


# ---- command line --------------------------------------------------------------------------------------------------
def test_cli(exported, tmp_path, capsys):
    fastlora_dir = exported.fast["nf4-bf16"].source
    assert main(["export-lora", str(fastlora_dir), str(tmp_path / "out"), "--subfolder", "second"]) == 0
    assert "Exported the adapter in the subfolder 'second'" in capsys.readouterr().out
    assert (tmp_path / "out" / WEIGHTS).read_bytes() == (fastlora_dir / "second" / WEIGHTS).read_bytes()
    assert main(["export-lora", str(fastlora_dir), str(tmp_path / "out")]) == 1
    assert "export-lora: error: `dst_dir`" in capsys.readouterr().err
    assert main(["export-lora", str(tmp_path / "missing"), str(tmp_path / "x")]) == 1
    assert "is not a folder" in capsys.readouterr().err
    for argv in (["--help"], ["export-lora", "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "export-lora" in out and "--overwrite" in out and "--subfolder" in out
    with pytest.raises(SystemExit) as exit_info:
        main(["export-lora"])  # SRC and DST are required
    assert exit_info.value.code == 2


def test_python_dash_m_and_console_script(exported, tmp_path):
    pyproject = (REPO / "pyproject.toml").read_text()  # (tomllib is not in Python 3.10)
    scripts = pyproject.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    assert 'peft-fastlora = "peft_fastlora.__main__:main"' in scripts
    src = exported.fast["nf4-bf16"].source
    proc = subprocess.run([sys.executable, "-m", "peft_fastlora", "export-lora", str(src), str(tmp_path / "out")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["peft_type"] == "LORA"


# ---- plain LoRA into FastLoRA --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain_lora(base_path, tmp_path_factory):
    """A stock PEFT LoRA adapter (fp32 tensors: PEFT upcasts) on the 4-bit base, and the stock model's logits."""
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM", init_lora_weights=False)
    model = get_peft_model(load_base(base_path, "nf4-bf16"), config).eval()
    path = tmp_path_factory.mktemp("plain-lora")
    model.save_pretrained(path)
    with model.disable_adapter():
        base_logits = logits(model)
    return SimpleNamespace(path=path, logits=logits(model), base_logits=base_logits)


@pytest.mark.parametrize("policy", peft_fastlora.ADAPTER_DTYPE_POLICIES)
def test_load_lora_as_fastlora(plain_lora, base_path, policy):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_lora_as_fastlora(load_base(base_path, "nf4-bf16"), plain_lora.path, adapter_dtype=policy)
    assert not [w for w in caught if "missing" in str(w.message).lower()]
    config = model.peft_config["default"]
    assert type(config) is peft_fastlora.FastLoraConfig and config.adapter_dtype == policy
    assert (config.r, config.lora_alpha) == (4, 8)
    layers = [m for m in model.modules() if isinstance(m, peft_fastlora.FastLoraLayer)]
    assert len(layers) == 14 and all(type(m) is FastLoraLinear4bit for m in layers)
    expected = BF16 if policy != "fp32" else FP32  # bf16 compute: fp32-if-fp16 gives bf16
    saved = load_file(plain_lora.path / WEIGHTS)
    got = adapter_tensors(model)
    assert got.keys() == saved.keys()
    assert all(got[k].dtype == expected and torch.equal(got[k], v.to(expected)) for k, v in saved.items())
    assert (plain_lora.logits - plain_lora.base_logits).float().abs().max() > MIN_ADAPTER_EFFECT
    torch.testing.assert_close(logits(model).float(), plain_lora.logits.float(), atol=ATOL["nf4-bf16"], rtol=0)


def test_export_then_load_lora_as_fastlora_is_exact(exported, base_path):
    """FastLoRA -> plain LoRA -> FastLoRA (same policy) gives back identical tensors and identical logits."""
    for case in ("nf4-bf16", "fp4-fp16-dq", "int8-fp16"):
        fast = exported.fast[case]
        model = load_lora_as_fastlora(load_base(base_path, case, exported.device), fast.path)
        saved = load_file(fast.source / WEIGHTS)
        got = adapter_tensors(model)
        assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in saved.items())
        assert torch.equal(logits(model, exported.device), fast.logits)


def test_load_lora_as_fastlora_into_a_peft_model(plain_lora, base_path):
    model = get_peft_model(load_base(base_path, "nf4-bf16"), fast_config(r=2))
    model = load_lora_as_fastlora(model, plain_lora.path, adapter_dtype="fp32", adapter_name="plain",
                                  is_trainable=True)
    assert set(model.peft_config) == {"default", "plain"}
    assert model.peft_config["plain"].adapter_dtype == "fp32"
    saved = load_file(plain_lora.path / WEIGHTS)
    assert all(torch.equal(adapter_tensors(model, "plain")[k], v) for k, v in saved.items())
    plain_params = [p for n, p in model.named_parameters() if ".plain." in n]
    assert plain_params and all(p.requires_grad for p in plain_params)
    model.set_adapter("plain")
    torch.testing.assert_close(logits(model).float(), plain_lora.logits.float(), atol=ATOL["nf4-bf16"], rtol=0)


def test_fastlora_config_from_lora_keeps_every_lora_field():
    lora = LoraConfig(r=6, lora_alpha=12, lora_dropout=0.1, target_modules=["q_proj", "v_proj"],
                      rank_pattern={"q_proj": 2}, alpha_pattern={"v_proj": 3}, use_rslora=True,
                      modules_to_save=["lm_head"], layers_to_transform=[0], layers_pattern="layers",
                      task_type="CAUSAL_LM", base_model_name_or_path="some/base", revision="v1")
    fast = fastlora_config_from_lora(lora, adapter_dtype="bf16", fp16_overflow_guard=True)
    assert type(fast) is peft_fastlora.FastLoraConfig and fast.peft_type == "FASTLORA"
    assert (fast.adapter_dtype, fast.fp16_overflow_guard) == ("bf16", True)
    for f in fields(LoraConfig):
        if f.name != "peft_type":
            assert getattr(fast, f.name) == getattr(lora, f.name), f.name
    assert fast.target_modules is not lora.target_modules  # a copy: changing one leaves the other alone


def test_load_lora_as_fastlora_errors(base_path, tmp_path):
    LoraConfig(r=2, target_modules=["q_proj"], use_dora=True).save_pretrained(tmp_path / "dora")
    with pytest.raises(ValueError, match="cannot be loaded into FastLoRA layers: .*DoRA"):
        load_lora_as_fastlora(torch.nn.Linear(2, 2), tmp_path / "dora")
    IA3Config(target_modules=["q_proj"], feedforward_modules=[]).save_pretrained(tmp_path / "ia3")
    with pytest.raises(ValueError, match="holds a IA3 adapter, not a LoRA one"):
        load_lora_as_fastlora(torch.nn.Linear(2, 2), tmp_path / "ia3")


def test_unquantized_lm_head_round_trips_through_export(base_path, tmp_path):
    """A FastLoRA model with a standard PEFT layer (unquantized lm_head) exports and re-imports exactly too."""
    torch.manual_seed(0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT: "Setting `save_embedding_layers` to `True`"
        model = get_peft_model(load_base(base_path, "fp4-fp16-dq"), fast_config(target_modules=targets))
        model.save_pretrained(tmp_path / "fastlora")
    export_lora(tmp_path / "fastlora", tmp_path / "lora")
    loaded = load_lora_as_fastlora(load_base(base_path, "fp4-fp16-dq"), tmp_path / "lora")
    assert type(loaded.base_model.model.lm_head) is PeftLoraLinear
    assert torch.equal(logits(loaded), logits(model))


# ---- nothing lost: the destination, corrupt sources, failed writes -------------------------------------------------
def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def two_adapters(base_path, tmp_path_factory):
    """A FastLoRA model saved with a default adapter and an fp32-policy one in the subfolder "second"."""
    torch.manual_seed(0)
    model = get_peft_model(load_base(base_path, "nf4-bf16"), fast_config(target_modules=["q_proj", "v_proj"]))
    model.add_adapter("second", fast_config(r=2, adapter_dtype="fp32", target_modules=["q_proj", "o_proj"]))
    root = tmp_path_factory.mktemp("two-adapters") / "root"
    model.save_pretrained(root)
    return SimpleNamespace(root=root, model=model)


@pytest.fixture
def source(two_adapters, tmp_path):
    """A fresh copy of the two-adapter folder, free to be damaged by one test."""
    return Path(shutil.copytree(two_adapters.root, tmp_path / "src"))


def run_cli(argv, capsys) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def test_subfolder_export_into_its_own_root_is_refused(source, capsys):
    """Issue 14.1: `export-lora ROOT ROOT --subfolder second --overwrite` replaced ROOT's default adapter."""
    before = snapshot(source)
    code, err = run_cli(["export-lora", source, source, "--subfolder", "second", "--overwrite"], capsys)
    assert code == 1 and "`dst_dir`" in err and "is `src_dir`" in err and "pick a new folder" in err
    assert snapshot(source) == before
    (source.parent / "link").symlink_to(source)  # the same folder by another name
    code, err = run_cli(["export-lora", source / "second", source.parent / "link" / "second", "--overwrite"], capsys)
    assert code == 1 and "adapter's own folder" in err
    code, err = run_cli(["export-lora", source, source.parent / "link", "--subfolder", "second", "--overwrite"],
                        capsys)
    assert code == 1 and "is `src_dir`" in err
    assert snapshot(source) == before


def test_overwrite_refuses_a_folder_holding_another_adapter(source, tmp_path, capsys):
    before = snapshot(source)
    # the default adapter into the "second" adapter's folder; the second into a folder holding a FastLoRA adapter
    for argv in (["export-lora", source, source / "second", "--overwrite"],
                 ["export-lora", source, tmp_path, "--subfolder", "second", "--overwrite"]):
        code, err = run_cli(argv, capsys)
        assert code == 1 and "holds another adapter" in err and "only replaces an earlier export-lora output" in err
    assert snapshot(source) == before
    plain = tmp_path / "plain"  # a LoRA adapter from elsewhere (not an export) is protected too
    plain.mkdir()
    (plain / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    code, err = run_cli(["export-lora", source, plain, "--overwrite"], capsys)
    assert code == 1 and "holds another adapter (in ['./'])" in err
    # an earlier export is what --overwrite replaces
    export_lora(source, tmp_path / "out")
    export_lora(source, tmp_path / "out", subfolder="second", overwrite=True)
    assert (tmp_path / "out" / WEIGHTS).read_bytes() == (source / "second" / WEIGHTS).read_bytes()


def _bad_header(src: Path) -> None:
    (src / WEIGHTS).write_bytes(b"\xff" * 64)


def _huge_header(src: Path) -> None:
    data = (src / WEIGHTS).read_bytes()
    (src / WEIGHTS).write_bytes((2**62).to_bytes(8, "little") + data[8:])


def _truncated_weights(src: Path) -> None:
    data = (src / WEIGHTS).read_bytes()
    (src / WEIGHTS).write_bytes(data[:-100])  # the header is intact, the last tensor is cut


def _config_is_a_list(src: Path) -> None:
    (src / "adapter_config.json").write_text("[1, 2]")


def _config_not_json(src: Path) -> None:
    (src / "adapter_config.json").write_text('{"peft_type": "FASTLORA",')


def _facts(src: Path, change) -> None:
    text = (src / "README.md").read_text()
    start = text.index(model_card.FACTS_PREFIX) + len(model_card.FACTS_PREFIX)
    end = text.index(" -->", start)
    facts = json.loads(text[start:end])
    change(facts)
    (src / "README.md").write_text(text[:start] + json.dumps(facts) + text[end:])


def _incomplete_facts(src: Path) -> None:
    _facts(src, lambda f: f["quantization"].pop("compute_dtype"))


def _no_adapters_in_facts(src: Path) -> None:
    _facts(src, lambda f: f.update(adapters=[]))


def _crafted_facts(src: Path) -> None:
    _facts(src, lambda f: f["quantization"].update(compute_dtype="bfloat16, __import__('os').system('echo pwned')"))


def _unsafe_pickle(src: Path) -> None:
    (src / WEIGHTS).unlink()
    torch.save({"w": torch.ones(2), "code": SimpleNamespace(x=1)}, src / "adapter_model.bin")


CORRUPT = {
    "bad safetensors header": (_bad_header, "is not a valid safetensors file: its header length"),
    "huge header length": (_huge_header, "does not fit the file"),
    "truncated weights": (_truncated_weights, "describes .* bytes of tensor data but the file holds .* \\(truncated"),
    "config is a list": (_config_is_a_list, "holds a JSON list, not an object"),
    "config is not JSON": (_config_not_json, "is not valid JSON"),
    "incomplete card facts": (_incomplete_facts,
                              r"facts in .* are not valid: `quantization` lacks the field\(s\) \['compute_dtype'\]"),
    "no adapters in the facts": (_no_adapters_in_facts, "`adapters` is \\[\\], expected a non-empty list"),
    "crafted card facts": (_crafted_facts, "`quantization.compute_dtype` is \"bfloat16, __import__"),
    "pickle that is not weights-only": (_unsafe_pickle, "cannot be loaded as a weights-only pickle"),
}


@pytest.mark.parametrize("damage", list(CORRUPT))
def test_corrupt_source_is_refused_before_anything_is_written(source, tmp_path, capsys, damage):
    """Issue 14.8: a clear error, exit status 1, no traceback, DST untouched (an earlier export, or no folder)."""
    earlier = export_lora(source, tmp_path / "earlier")
    before = snapshot(earlier)
    corrupt, message = CORRUPT[damage]
    corrupt(source)
    code, err = run_cli(["export-lora", source, earlier, "--overwrite"], capsys)
    assert code == 1 and "Traceback" not in err
    assert err.startswith("peft-fastlora export-lora: error: ") and len(err.splitlines()) == 1
    assert __import__("re").search(message, err), err
    assert snapshot(earlier) == before
    code, _ = run_cli(["export-lora", source, tmp_path / "new"], capsys)
    assert code == 1 and not (tmp_path / "new").exists()
    assert not [p for p in tmp_path.iterdir() if ".peft-fastlora-tmp-" in p.name]


def test_corrupt_source_in_a_subprocess_has_no_traceback(source, tmp_path):
    _truncated_weights(source)
    proc = subprocess.run([sys.executable, "-m", "peft_fastlora", "export-lora", str(source), str(tmp_path / "out")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "truncated" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_failed_export_write_leaves_the_earlier_export(source, tmp_path, monkeypatch):
    """Issue 14.2 for export: `--overwrite` wrote the config, deleted the old weights, then copied."""
    earlier = export_lora(source, tmp_path / "earlier")
    (earlier / "notes.txt").write_text("mine")
    before = snapshot(earlier)

    def full_disk(src, dst, *args, **kwargs):
        Path(dst).write_bytes(b"\0" * 10)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(peft_fastlora.export.shutil, "copyfile", full_disk)
    with pytest.raises(OSError, match="No space left"):
        export_lora(source, earlier, subfolder="second", overwrite=True)
    assert snapshot(earlier) == before
    assert not [p for p in tmp_path.iterdir() if ".peft-fastlora-tmp-" in p.name]
    monkeypatch.undo()
    export_lora(source, earlier, subfolder="second", overwrite=True)
    after = snapshot(earlier)
    assert after["notes.txt"] == b"mine" and after[WEIGHTS] == (source / "second" / WEIGHTS).read_bytes()


def test_pickle_weights_are_exported_as_safetensors(source, tmp_path):
    """Issue 14.10: a pickle adapter_model.bin is converted (loaded weights_only), never copied; never both files."""
    tensors = load_file(source / WEIGHTS)
    torch.save(tensors, source / "adapter_model.bin")
    both = export_lora(source, tmp_path / "both")  # safetensors wins (PEFT loads it when both exist): copied as is
    assert {p.name for p in both.iterdir()} == {"adapter_config.json", WEIGHTS, "README.md"}
    assert (both / WEIGHTS).read_bytes() == (source / WEIGHTS).read_bytes()
    (source / WEIGHTS).unlink()
    out = export_lora(source, tmp_path / "bin")
    assert {p.name for p in out.iterdir()} == {"adapter_config.json", WEIGHTS, "README.md"}
    got = load_file(out / WEIGHTS)
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], v) for k, v in tensors.items())
    assert "converted from `adapter_model.bin` to safetensors" in (out / "README.md").read_text()
    (tmp_path / "stale").mkdir()  # an earlier export's pickle in DST goes: DST never holds both
    (tmp_path / "stale" / "adapter_model.bin").write_bytes(b"old")
    export_lora(source, tmp_path / "stale", overwrite=True)
    assert not (tmp_path / "stale" / "adapter_model.bin").exists()


@pytest.mark.parametrize("how", ["fastlora", "export"])
def test_load_lora_as_fastlora_keeps_the_saved_policy(source, base_path, tmp_path, how):
    """Issue 14.12: an fp32-policy adapter stays fp32 (it was rounded to bf16 under the default policy)."""
    folder = source / "second" if how == "fastlora" else export_lora(source, tmp_path / "out", subfolder="second")
    model = load_lora_as_fastlora(load_base(base_path, "nf4-bf16"), folder)
    assert model.peft_config["default"].adapter_dtype == "fp32"
    saved = load_file(source / "second" / WEIGHTS)
    got = adapter_tensors(model)
    assert got.keys() == saved.keys()
    assert all(got[k].dtype == FP32 and torch.equal(got[k], v) for k, v in saved.items())
    explicit = load_lora_as_fastlora(load_base(base_path, "nf4-bf16"), folder, adapter_dtype="bf16")
    assert all(v.dtype == BF16 for v in adapter_tensors(explicit).values())  # an explicit policy still wins


def test_export_of_an_adapter_the_card_does_not_describe(two_adapters, tmp_path):
    """A later save of only the default adapter rewrote the card: the second adapter's facts come from its files."""
    root = tmp_path / "root"
    shutil.copytree(two_adapters.root, root)
    two_adapters.model.save_pretrained(root, selected_adapters=["default"])
    facts = model_card.read_facts((root / "README.md").read_text())
    assert [a["name"] for a in facts["adapters"]] == ["default"]
    out = export_lora(root, tmp_path / "out", subfolder="second")
    exported = model_card.read_facts((out / "README.md").read_text())
    (adapter,) = exported["adapters"]
    assert adapter == {"name": "default", "subfolder": None, "adapter_dtype": "fp32", "dtypes": {"fp32": 4},
                       "r": 2, "lora_alpha": 8}
    assert exported["quantization"] == facts["quantization"]
