# ruff: noqa
"""Unsloth QLoRA (nf4) training-step + greedy-decode benchmark, Llama-3-8B-shaped (8 layers), random weights.

Mirrors a plain PyTorch QLoRA training loop (same LlamaConfig, seed, step loop, median, tok/s, peak GiB, table)
so its rows compare with the peft-nf4 / bf16 rows there. Offline: builds the model and a 32000-entry tokenizer in code.

Env (all optional):
  LAYERS=8  BATCH=1,4 (comma list)  STEPS=8  GC=False,unsloth,True (comma list; 0/1 accepted)
  GEN=1 (greedy decode, last, on a freshly loaded model)  GEN_REPEATS=1 (timed generates; the median is reported)  LORA_BF16=1 (cast trainable params to bf16 as the reference loop does;
  0 keeps Unsloth's own fp32 LoRA weights)  BUDGET_S=520 (skip phases that would start after this many seconds)
  OUT=<dir> (writes unsloth.json = rows, unsloth_env.json = versions/preflight/tracebacks)
Every phase runs in try/except and prints its full traceback, so one failure does not hide the others.
"""
import os, sys, time

T0 = time.perf_counter()
# ---- offline / no-telemetry, set before anything imports huggingface_hub / unsloth -----------------------------
for _k, _v in {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",  # no hub calls; unsloth's
    # has_internet() / stats / mapper refresh all short-circuit on these
    "UNSLOTH_DISABLE_STATISTICS": "1",  # unsloth get_statistics(): presence alone disables it
    "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_ENABLE_HF_TRANSFER": "0", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
    "UNSLOTH_COMPILE_LOCATION": "/tmp/unsloth_compiled_cache",  # default is ./unsloth_compiled_cache (cwd)
}.items():
    os.environ.setdefault(_k, _v)

import gc, json, platform, shutil, subprocess, tempfile, traceback, importlib, importlib.util

LAYERS = int(os.environ.get("LAYERS", "8")); SEQ = 2048; VOCAB = 32000
BATCHES = [int(b) for b in os.environ.get("BATCH", "1,4").split(",") if b.strip()]
STEPS, WARM = int(os.environ.get("STEPS", "8")), 3
_GCMAP = {"0": False, "false": False, "1": True, "true": True, "unsloth": "unsloth"}
GCS = [_GCMAP.get(g.strip().lower(), g.strip()) for g in os.environ.get("GC", "False,unsloth,True").split(",") if g.strip()]
GEN = os.environ.get("GEN", "1") == "1"
GEN_REPEATS = max(1, int(os.environ.get("GEN_REPEATS", "1")))
LORA_BF16 = os.environ.get("LORA_BF16", "1") == "1"
BUDGET_S = float(os.environ.get("BUDGET_S", "520"))
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROVIDER = "unsloth-nf4"
OUT = os.environ.get("OUT")

ROWS, ENV = [], {"errors": {}, "preflight": {}, "timing_s": {}}


def gc_code(g):  # the reference loop writes grad_ckpt as 0/1; Unsloth's offloaded mode stays "unsloth"
    return g if isinstance(g, str) else int(bool(g))


def el():
    return time.perf_counter() - T0


def log(*a):
    print(f"[{el():7.1f}s]", *a, flush=True)


def dump():
    if not OUT:
        return
    try:
        os.makedirs(OUT, exist_ok=True)
        json.dump(ROWS, open(os.path.join(OUT, "unsloth.json"), "w"), indent=1, default=str)
        json.dump(ENV, open(os.path.join(OUT, "unsloth_env.json"), "w"), indent=1, default=str)
    except Exception:
        traceback.print_exc()


def phase(name, fn, *a, **k):
    """Run fn; on failure print + record the full traceback and return None."""
    log(f"=== {name}")
    t = time.perf_counter()
    try:
        r = fn(*a, **k)
        ENV["timing_s"][name] = round(time.perf_counter() - t, 2)
        log(f"=== {name}: ok ({time.perf_counter() - t:.1f}s)")
        return r
    except BaseException as e:  # noqa: BLE001 - keep going on anything but Ctrl-C
        if isinstance(e, KeyboardInterrupt):
            raise
        tb = traceback.format_exc()
        print(tb, file=sys.stdout, flush=True)
        ENV["errors"][name] = tb[-6000:]
        ENV["timing_s"][name] = round(time.perf_counter() - t, 2)
        log(f"=== {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
        return None
    finally:
        dump()


def err(name):
    """Last line of a phase's traceback (the exception), for table rows; the full one is in unsloth_env.json."""
    lines = [l for l in ENV["errors"].get(name, "").strip().splitlines() if l.strip()]
    return lines[-1][-300:] if lines else ""


def fits(name, need_s):
    if el() + need_s > BUDGET_S:
        log(f"=== {name}: SKIPPED (elapsed {el():.0f}s + ~{need_s:.0f}s > BUDGET_S={BUDGET_S:.0f})")
        ENV["errors"][name] = f"skipped: time budget (elapsed {el():.0f}s)"
        dump()
        return False
    return True


# ---- 1. versions, GPU, environment -------------------------------------------------------------------------------
def pkg_report():
    from importlib.metadata import version, PackageNotFoundError
    names = ["torch", "triton", "transformers", "accelerate", "peft", "trl", "bitsandbytes", "unsloth", "unsloth_zoo",
             "datasets", "dill", "multiprocess", "pyarrow", "pandas", "fsspec", "huggingface_hub", "safetensors",
             "tokenizers", "sentencepiece", "numpy", "torchvision", "torchao", "xformers", "flash_attn", "tyro",
             "msgspec", "cut_cross_entropy", "hf_transfer", "diffusers", "pydantic", "psutil", "packaging",
             "protobuf", "einops", "regex", "requests", "rich", "xxhash"]
    mods = {"huggingface_hub": "huggingface_hub", "protobuf": "google.protobuf"}
    rep = {}
    for n in names:
        try:
            v = version(n)
        except PackageNotFoundError:
            v = None
        try:
            spec = importlib.util.find_spec(mods.get(n, n))
            where = (spec.origin or str(list(spec.submodule_search_locations or []))) if spec else None
        except Exception as e:  # a broken parent package can raise here
            where = f"find_spec error: {e!r}"
        if where and "/tmp/site" in where:
            where = "KIT:" + where
        rep[n] = {"version": v, "where": where}
        print(f"  {n:18s} {str(v):22s} {where}")
    return rep


def gpu_report():
    import torch
    r = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
         "device_count": torch.cuda.device_count()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        r.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                 mem_gib=round(p.total_memory / 2**30, 1), bf16=torch.cuda.is_bf16_supported())
    for k, v in r.items():
        print(f"  {k:16s} {v}")
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        r["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        print("  nvidia-smi      ", r["nvidia_smi"])
    except Exception as e:
        r["nvidia_smi"] = repr(e)
    return r


def host_report():
    r = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
         "cwd": os.getcwd(), "PYTHONPATH": os.environ.get("PYTHONPATH"), "sys_path_head": sys.path[:4],
         "cc": {c: shutil.which(c) for c in ("cc", "gcc", "clang", "nvcc")}, "CC": os.environ.get("CC"),
         "env": {k: v for k, v in sorted(os.environ.items())
                 if k.startswith(("UNSLOTH", "HF_", "TRANSFORMERS", "BNB", "CUDA", "PYTORCH", "TORCH", "TRITON",
                                  "LAYERS", "BATCH", "STEPS", "GC", "GEN", "LORA", "BUDGET", "NVIDIA_VISIBLE"))}}
    import sysconfig
    inc = sysconfig.get_paths().get("include")
    r["python_h"] = bool(inc and os.path.exists(os.path.join(inc, "Python.h")))
    for k, v in r.items():
        print(f"  {k:16s} {v}")
    return r


# ---- 2. preflight: bitsandbytes CUDA lib + a Triton kernel (both needed by Unsloth's QLoRA path) ---------------
def bnb_check(dev="cuda"):
    import torch, bitsandbytes as bnb, bitsandbytes.functional as F
    from bitsandbytes import cextension
    lib = getattr(cextension, "lib", None)
    r = {"version": bnb.__version__, "backend": getattr(cextension, "BNB_BACKEND", None),
         "lib": type(lib).__name__, "compiled_with_cuda": getattr(lib, "compiled_with_cuda", None),
         "shipped_libs": sorted(f for f in os.listdir(os.path.dirname(bnb.__file__)) if f.startswith("libbitsandbytes"))}
    try:
        r["lib_file"] = str(cextension.get_cuda_bnb_library_path(cextension.get_cuda_specs())) if dev == "cuda" else None
    except Exception as e:
        r["lib_file"] = repr(e)
    w = torch.randn(256, 512, device=dev, dtype=torch.bfloat16)
    q, st = F.quantize_4bit(w, quant_type="nf4", compress_statistics=True)
    d = F.dequantize_4bit(q, st)
    r["nf4_roundtrip_rel_err"] = round(float(((d.float() - w.float()).norm() / w.float().norm()).item()), 4)
    for rows in (1, 3):  # 1 row = inference gemv kernel, 3 rows = dequant + matmul
        x = torch.randn(rows, 512, device=dev, dtype=torch.bfloat16)
        y = bnb.matmul_4bit(x, q.t(), quant_state=st)
        ref = x.float() @ d.float().t()
        r[f"matmul_4bit_{rows}row_rel_err"] = round(float(((y.float() - ref).norm() / ref.norm()).item()), 4)
    if dev == "cuda":
        torch.cuda.synchronize()
    print("  ", r)
    assert r["nf4_roundtrip_rel_err"] < 0.2 and r["matmul_4bit_3row_rel_err"] < 0.05, r
    return r


def triton_check():
    import torch, triton, triton.language as tl

    @triton.jit
    def _add(x_ptr, y_ptr, o_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tl.store(o_ptr + i, tl.load(x_ptr + i, mask=m) + tl.load(y_ptr + i, mask=m), mask=m)

    x = torch.randn(4096, device="cuda"); y = torch.randn(4096, device="cuda"); o = torch.empty_like(x)
    _add[(4,)](x, y, o, 4096, BLOCK=1024)
    torch.cuda.synchronize()
    assert torch.allclose(o, x + y)
    print("   triton", triton.__version__, "vector-add kernel compiled and ran")
    return {"triton": triton.__version__, "ok": True}


# ---- 3. unsloth import -------------------------------------------------------------------------------------------
def import_unsloth():
    import unsloth  # noqa: F401  (must precede transformers/peft/trl)
    from unsloth import FastLanguageModel
    r = {"version": getattr(unsloth, "__version__", None)}
    try:
        from unsloth.models import _utils as U
        for k in ("DEVICE_TYPE", "SUPPORTS_BFLOAT16", "HAS_FLASH_ATTENTION", "HAS_FLASH_ATTENTION_SOFTCAPPING",
                  "xformers_version", "IS_ATTENTION_REFACTOR"):
            if hasattr(U, k):
                r[k] = getattr(U, k)
    except Exception as e:
        r["probe_error"] = repr(e)
    print("  ", r)
    return FastLanguageModel, r


# ---- 4. model + tokenizer on disk (same config/seed/construction as the reference loop) --------------------------------
def build_checkpoint():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=LAYERS, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=VOCAB, max_position_embeddings=4096, attn_implementation="sdpa")
    tmp = tempfile.mkdtemp(prefix="unsloth_bench_")
    torch.manual_seed(0)
    with torch.device(os.environ.get("BENCH_BUILD_DEVICE", "cuda")):  # env only for a CPU smoke test of this step
        m = LlamaForCausalLM(cfg).to(torch.bfloat16)
    m.save_pretrained(tmp)
    del m; gc.collect(); torch.cuda.empty_cache()
    # Unsloth's FastLanguageModel.from_pretrained always loads a tokenizer from the checkpoint dir (load_correct_tokenizer
    # + patch_tokenizer/check_tokenizer). WordLevel, exactly VOCAB entries; a distinct in-vocab <pad> so Unsloth's
    # pad-token fixer never adds a token (which would resize the embeddings).
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
    vocab.update({f"t{i}": i for i in range(4, VOCAB)})
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", model_max_length=4096)
    tok.save_pretrained(tmp)
    log("checkpoint", tmp, sorted(os.listdir(tmp)))
    return tmp


# ---- 5. load + LoRA ---------------------------------------------------------------------------------------------
def load_peft(FLM, ckpt, gc_mode):
    import torch
    a0 = torch.cuda.memory_allocated() / 2**30  # > 0 here means an earlier config's model was not freed
    model, tok = FLM.from_pretrained(ckpt, load_in_4bit=True, dtype=torch.bfloat16, max_seq_length=SEQ,
                                     use_gradient_checkpointing=gc_mode)
    assert model.get_input_embeddings().weight.shape[0] == VOCAB, model.get_input_embeddings().weight.shape
    model = FLM.get_peft_model(model, r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=0, bias="none",
                               use_gradient_checkpointing=gc_mode, random_state=3407)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    dts = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})
    n4 = sum(1 for mod in model.modules() if type(mod).__module__.startswith("bitsandbytes.nn"))
    fwd = {}
    try:  # which forward functions are installed: shows whether Unsloth's fused LoRA/attention path is in use
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        layer0 = inner.model.layers[0]
        for k, mod in (("model", inner), ("decoder", inner.model), ("layer", layer0),
                       ("attn", layer0.self_attn), ("mlp", layer0.mlp)):
            f = mod.forward
            fwd[k] = f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', repr(f))}"
    except Exception as e:
        fwd["error"] = repr(e)
    log(f"loaded: trainable={n_train:,} dtypes={dts} bnb 4-bit linears={n4} "
        f"alloc={torch.cuda.memory_allocated() / 2**30:.2f} GiB forwards={fwd}")
    return model, {"trainable": n_train, "lora_dtypes_native": dts, "linear4bit": n4, "forwards": fwd,
                   "alloc_before_load_gib": round(a0, 3)}


def block_state(model):
    """Unsloth (torch >= 2.11) torch.compiles each decoder block during training and demotes a block to the stock
    forward if compiling fails; report per-layer mode so a row shows whether compiled blocks were really used."""
    try:
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        layers = list(inner.model.layers)
        names = {0: "off", 1: "full", 2: "split", None: "unset"}
        modes = [names.get(l.__dict__.get("_unsloth_block_mode"), str(l.__dict__.get("_unsloth_block_mode")))
                 for l in layers]
        return {"class_wrapped": bool(getattr(type(layers[0]).forward, "_unsloth_block_compiled", False)),
                "modes": {m: modes.count(m) for m in sorted(set(modes))},
                "UNSLOTH_BLOCK_COMPILE": os.environ.get("UNSLOTH_BLOCK_COMPILE", "1(default)")}
    except Exception as e:
        return {"error": repr(e)}


# ---- 6. training step, exactly as the reference loop --------------------------------------------------------------
def train(model, batch, gc_mode, info):
    import torch
    model.train()
    if LORA_BF16:
        for p in model.parameters():
            if p.requires_grad: p.data = p.data.to(torch.bfloat16)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    x = torch.randint(0, VOCAB, (batch, SEQ), device="cuda")
    torch.cuda.reset_peak_memory_stats(); times = []
    for i in range(WARM + STEPS):
        torch.cuda.synchronize(); t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(); times.append(time.perf_counter() - t)
        if i < WARM:
            log(f"  warm-up step {i}: {times[-1] * 1e3:.0f} ms loss={loss.item():.4f}")
    med = sorted(times[WARM:])[STEPS // 2]
    r = dict(provider=PROVIDER, grad_ckpt=gc_code(gc_mode), batch=batch, step_s=med, tok_s=batch * SEQ / med,
             peak_gib=torch.cuda.max_memory_allocated() / 2**30, loss=loss.item(),
             lora_dtype="bf16" if LORA_BF16 else "unsloth-native", step_times_ms=[round(t * 1e3, 1) for t in times],
             block_compile=block_state(model), **info)
    del opt, loss; gc.collect(); torch.cuda.empty_cache()
    return r


# ---- 7. greedy decode, as the reference generation but through FastLanguageModel.for_inference --------------------------
def generate(FLM, model):
    import torch
    model = FLM.for_inference(model) or model
    x = torch.randint(0, VOCAB, (1, 64), device="cuda")
    # explicit all-ones mask = what HF infers for the reference model (its config has no pad id); here pad id 3 is set, and HF
    # would otherwise mask any random token equal to 3
    kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=128, min_new_tokens=128, do_sample=False)
    out = model.generate(input_ids=x, **kw)
    times = []
    for _ in range(GEN_REPEATS):  # eager decoding is host-bound: one generate moves by tens of percent
        torch.cuda.synchronize(); t = time.perf_counter()
        out = model.generate(input_ids=x, **kw)
        torch.cuda.synchronize(); times.append(time.perf_counter() - t)
    dt = sorted(times)[len(times) // 2]
    return dict(provider=PROVIDER, phase="gen", gen_tok_s=128 / dt, gen_s=dt, out_len=int(out.shape[-1]),
                gen_tok_s_each=[round(128 / t, 1) for t in times])


def free():
    """Between GC configs: drop compiled graphs (they can pin the old model) and cached blocks."""
    import torch
    try:
        torch._dynamo.reset()
    except Exception:
        traceback.print_exc()
    gc.collect(); torch.cuda.empty_cache()


def main():
    log(f"bench_unsloth: LAYERS={LAYERS} SEQ={SEQ} BATCH={BATCHES} STEPS={STEPS} GC={GCS} GEN={GEN} "
        f"LORA_BF16={LORA_BF16} BUDGET_S={BUDGET_S}")
    ENV["config"] = dict(layers=LAYERS, seq=SEQ, batches=BATCHES, steps=STEPS, warm=WARM, gc=GCS, gen=GEN,
                         lora_bf16=LORA_BF16)
    ENV["host"] = phase("host", host_report)
    ENV["packages"] = phase("packages", pkg_report)  # find_spec only: imports nothing heavy
    # unsloth first (before transformers/peft/trl and before CUDA is initialised), as Unsloth requires
    got = phase("import unsloth", import_unsloth)
    ENV["gpu"] = phase("gpu", gpu_report)
    ENV["preflight"]["triton"] = phase("preflight triton", triton_check)
    ENV["preflight"]["bitsandbytes"] = phase("preflight bitsandbytes", bnb_check)
    if got is None:
        log("cannot continue without unsloth; see traceback above")
        return
    FLM, ENV["unsloth"] = got
    ckpt = phase("build checkpoint", build_checkpoint)
    if ckpt is None:
        return
    for gc_mode in GCS:
        name = f"load gc={gc_mode}"
        if not fits(name, 60):
            continue
        got = phase(name, load_peft, FLM, ckpt, gc_mode)
        if got is None:
            for b in BATCHES:
                ROWS.append(dict(provider=PROVIDER, grad_ckpt=gc_code(gc_mode), batch=b,
                                 error="load failed: " + err(name)))
            continue
        model, info = got
        for b in BATCHES:
            tname = f"train gc={gc_mode} batch={b}"
            if not fits(tname, 45):
                continue
            r = phase(tname, train, model, b, gc_mode, info)
            if r is None:
                r = dict(provider=PROVIDER, grad_ckpt=gc_code(gc_mode), batch=b, error=err(tname))
            ROWS.append(r); print(r, flush=True); dump()
        del model, got
        free()
    # decode last, on a fresh model + fresh LoRA (B = 0) like the reference generation; training rows come first
    if GEN and fits("gen", 75):
        got = phase("load for gen", load_peft, FLM, ckpt, False)
        r = phase("gen", generate, FLM, got[0]) if got is not None else None
        ROWS.append(r if r is not None else dict(provider=PROVIDER, phase="gen",
                                                 error=err("gen") or "load failed: " + err("load for gen")))
        print(ROWS[-1], flush=True); dump()
    shutil.rmtree(ckpt, ignore_errors=True)


if __name__ == "__main__":
    try:
        main()
    finally:
        print(f"\n{'provider':14s} {'ckpt':8s} {'batch':>5s} {'tok/s':>9s} {'step ms':>8s} {'peak GiB':>8s} {'loss':>7s}")
        for r in ROWS:
            if r.get("phase") == "gen":
                print(f"{r['provider']:14s} gen: " + (f"{r['gen_tok_s']:.1f} tok/s (128 new tokens, greedy, batch 1)"
                                                       if "gen_tok_s" in r else "ERROR " + r.get("error", "")[-200:]))
            elif "error" in r:
                print(f"{r['provider']:14s} {str(r['grad_ckpt']):8s} {r['batch']:5d} ERROR {r['error'][-200:]}")
            else:
                print(f"{r['provider']:14s} {str(r['grad_ckpt']):8s} {r['batch']:5d} {r['tok_s']:9.0f} "
                      f"{r['step_s'] * 1e3:8.1f} {r['peak_gib']:8.2f} {r['loss']:7.3f}")
        if ENV["errors"]:
            print("\nphases with errors:", ", ".join(ENV["errors"]))
        print(f"total {el():.0f}s" + (f"; JSON in {OUT}/unsloth.json, {OUT}/unsloth_env.json" if OUT else
                                     "; set OUT=<dir> for JSON"), flush=True)
        dump()
