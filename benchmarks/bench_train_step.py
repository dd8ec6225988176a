"""End-to-end benchmark: LoRA training steps and greedy generation on a Llama-3-8B-shaped model (8 decoder layers).

The model (hidden 4096, intermediate 14336, 32 heads / 8 KV heads, vocab 32000, random bf16 weights) is built in
code on the device, saved once to a local directory (``--model-dir``, default a temporary one that is deleted at the
end; reuse it across runs with ``--model-dir DIR --keep-model``) and loaded quantized through the normal
transformers path: ``from_pretrained(dir, quantization_config=BitsAndBytesConfig(...), device_map={"": 0})``.

Providers (LoRA r=16 on every linear layer, AdamW, bf16 autocast, ``model.train()``):
  bf16-lora                        PEFT LoRA on the unquantized bf16 model (the ceiling)
  peft-bnb-nf4, -nf4-dq, -int8     PEFT LoRA on the bitsandbytes model
  fastlora-nf4, -nf4-dq, -int8     FastLoRA (``FastLoraConfig``) on the same bitsandbytes model
  fastpath-nf4                     FastLoRA + ``peft_fastlora.enable_fast_path`` (fused loss, fused MLP, Liger's norm
                                   and RoPE; offload if checkpointed)
  fastpath-graph-nf4               the fast path with the step recorded as CUDA graphs (``GraphedTrainStep``; its
                                   recording counts towards the peak memory; eager on the CPU)
  fastpath-ligerloss-nf4           the same with Liger's fused loss instead of ours (not run by default)
  fastlora-liger-nf4, fastlora-compiled-nf4   the fast path's halves (not run by default)
  unsloth-nf4                      Unsloth's own step (``unsloth_step.py``; not run by default, needs Unsloth)

By default each provider runs in its own process (a child of this one; the parent merges the rows and derives the
ratios): peak memory only compares that way, and Unsloth patches transformers on import. ``--in-process`` runs them
all here instead, one model resident at a time during training.

Each trains at sequence 2048, batch 1 and 4, with and without gradient checkpointing (non-reentrant; ``--reentrant``
for the other kind): tokens/s is the median over timed steps after warm-up (``torch.cuda.synchronize`` around each
step), peak memory is ``torch.cuda.max_memory_allocated`` since a reset before the first step. ``--profile PROVIDER``
writes the top-20 CUDA kernels of one training step.

Greedy generation (batch 1, 128 new tokens, adapter active) gives decode tokens/s after training, the median and
min/max over ``--gen-repeats`` generates. In one process (``--in-process``) every ``--gen-providers`` model is kept
resident and timed in interleaved rounds (round i starts at provider i mod P), and the ratio to bf16 LoRA is also
taken round by round (``ratio_to_bf16_round_*``): a same-round ratio cancels the host's drift. With ``--budget-s``,
training and profiling stop ``--gen-reserve-s`` early so that the generation phase keeps its share of the budget.

``--arch qwen2`` / ``--arch mistral`` runs the same 8-layer cut of Qwen2-7B or Mistral-7B instead, ``--arch llama-1b``
the whole of Llama-3.2-1B's shape (16 layers, tied embeddings: the small models RL fine-tuning generates with) (not
Unsloth, whose script builds the Llama-3-8B model).

GPU:   python benchmarks/bench_train_step.py --out benchmarks/results
CI:    python benchmarks/bench_train_step.py --device cpu --tiny --out /tmp/x
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional

import _common as C
import torch

LLAMA3_8B_8_LAYERS = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_hidden_layers=8,
    vocab_size=32000,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
# intermediate 128: bitsandbytes' CPU 4-bit matmul needs in_features % 64 == 0 (down_proj reads the intermediate).
TINY = dict(LLAMA3_8B_8_LAYERS, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=2, vocab_size=128, max_position_embeddings=256)  # fmt: skip
# The same 8-layer cut of two more architectures that Liger-Kernel supports, so the fast path is measured beyond Llama:
# Qwen2-7B (biases on q/k/v, 152k vocabulary: the loss is a larger share of the step) and Mistral-7B v0.3 (32k
# vocabulary, no sliding window).
ARCH_SHAPES = {
    "llama": LLAMA3_8B_8_LAYERS,
    "qwen2": dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                  num_hidden_layers=8, vocab_size=152064, max_position_embeddings=8192, rms_norm_eps=1e-6,
                  rope_theta=1e6, tie_word_embeddings=False),
    "mistral": dict(LLAMA3_8B_8_LAYERS, vocab_size=32768, rope_theta=1e6, sliding_window=None),
    # all 16 layers: none of its linear shapes is in the small-M tuning table (the heuristic's tilings run)
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=64, num_hidden_layers=16, vocab_size=128256, max_position_embeddings=8192,
                     rms_norm_eps=1e-5, rope_theta=5e5, tie_word_embeddings=True),
}
ARCH_NAMES = {"llama": "Llama-3-8B", "qwen2": "Qwen2-7B", "mistral": "Mistral-7B", "llama-1b": "Llama-3.2-1B"}
MODEL_TYPES = {"llama-1b": "llama"}  # transformers' model_type where it is not the --arch name
RANK = 16

# provider -> (quantization, tuner), in run order: the ceiling first, then each quantization's PEFT and FastLoRA.
PROVIDERS = {
    "bf16-lora": (None, "peft"),
    "peft-bnb-nf4": ("nf4", "peft"),
    "fastlora-nf4": ("nf4", "fastlora"),
    "peft-bnb-int8": ("int8", "peft"),
    "fastlora-int8": ("int8", "fastlora"),
    "peft-bnb-nf4-dq": ("nf4-dq", "peft"),
    "fastlora-nf4-dq": ("nf4-dq", "fastlora"),
    # The whole-step fast path (peft_fastlora.enable_fast_path) and its two halves, on FastLoRA nf4.
    "fastpath-nf4": ("nf4", "fastpath"),
    "fastlora-liger-nf4": ("nf4", "fastpath-liger-only"),
    "fastlora-compiled-nf4": ("nf4", "fastpath-compile-only"),
    "fastpath-lossonly-nf4": ("nf4", "fastpath-loss-only"),
    "fastpath-ligerloss-nf4": ("nf4", "fastpath-liger-loss"),
    # The fast path with the whole LoRA MLP as one op (fuse_mlp="all": each LoRA term inside its base matmul).
    "fastpath-mlp-nf4": ("nf4", "fastpath-mlp"),
    # The fast path with the step recorded as CUDA graphs (peft_fastlora.GraphedTrainStep; eager on the CPU).
    "fastpath-graph-nf4": ("nf4", "fastpath-graph"),
    # Unsloth's own QLoRA step (benchmarks/unsloth_step.py), always in its own process; its checkpointing row uses
    # Unsloth's offloading mode ("unsloth").
    "unsloth-nf4": ("nf4", "unsloth"),
}
# What runs without --providers: everything but the fast path's halves and Unsloth (which needs its own install).
DEFAULT_PROVIDERS = [p for p in PROVIDERS if p not in ("fastlora-liger-nf4", "fastlora-compiled-nf4",
                                                       "fastpath-lossonly-nf4", "fastpath-ligerloss-nf4",
                                                       "fastpath-mlp-nf4", "unsloth-nf4")]  # fmt: skip
# enable_fast_path options per fast-path tuner; activation offload applies only to the checkpointed rows.
FAST_PATH_OPTIONS = {
    "fastpath": dict(liger="auto", compile_blocks=False, offload_activations=True),
    "fastpath-liger-only": dict(liger=True, compile_blocks=False, offload_activations=False),
    "fastpath-compile-only": dict(liger=False, compile_blocks=True, offload_activations=False),
    "fastpath-loss-only": dict(liger=["fused_linear_cross_entropy"], compile_blocks=False, offload_activations=True),
    # The fast path with Liger's fused linear cross-entropy instead of ours.
    "fastpath-liger-loss": dict(liger="auto", compile_blocks=False, offload_activations=True, fused_loss=False),
    "fastpath-mlp": dict(liger="auto", compile_blocks=False, offload_activations=True, fuse_mlp="all"),
    "fastpath-graph": dict(liger="auto", compile_blocks=False, offload_activations=True),
}
# Tuners whose step is a peft_fastlora.GraphedTrainStep instead of train_step.
GRAPHED_TUNERS = {"fastpath-graph"}
PEFT_TWIN = {"fastlora-nf4": "peft-bnb-nf4", "fastlora-nf4-dq": "peft-bnb-nf4-dq", "fastlora-int8": "peft-bnb-int8",
             "fastpath-nf4": "peft-bnb-nf4", "fastlora-liger-nf4": "peft-bnb-nf4",
             "fastlora-compiled-nf4": "peft-bnb-nf4", "fastpath-lossonly-nf4": "peft-bnb-nf4",
             "fastpath-ligerloss-nf4": "peft-bnb-nf4", "fastpath-graph-nf4": "peft-bnb-nf4",
             "fastpath-mlp-nf4": "peft-bnb-nf4",
             "unsloth-nf4": "peft-bnb-nf4"}  # fmt: skip
COLORS = {p: f"C{i}" for i, p in enumerate(PROVIDERS)}
GEN_PROVIDERS = ["bf16-lora", "peft-bnb-nf4", "fastlora-nf4", "peft-bnb-int8", "fastlora-int8"]

TRAIN_COLUMNS = [
    "provider", "quant", "tuner", "batch", "seq", "ckpt", "adapter_dtype", "fastlora_layers", "warmup_steps", "steps",
    "median_step_ms", "host_ms", "tokens_per_s", "ratio_to_bf16", "ratio_to_peft_bnb", "ratio_to_unsloth", "peak_GiB",
    "peak_vs_peft_bnb", "peak_vs_unsloth", "resident_GiB", "loss", "load_s",
    "status", "error",
]  # fmt: skip
# tokens_per_s (and seconds) are medians over the rounds; round_tokens_per_s lists every round's, ";"-separated, so
# that the same-round ratios (ratio_to_bf16_round_*) can be derived again from the CSV (--replot).
GEN_COLUMNS = [
    "provider", "quant", "tuner", "prompt", "new_tokens", "repeats", "seconds", "tokens_per_s", "tokens_per_s_min",
    "tokens_per_s_max", "ratio_to_bf16", "ratio_to_bf16_round_median", "ratio_to_bf16_round_min",
    "ratio_to_bf16_round_max", "ratio_to_peft_bnb", "ratio_to_unsloth", "round_tokens_per_s",
    "status", "error",
]  # fmt: skip
SETUP_COLUMNS = ["step", "provider", "seconds", "note"]


# ---- model -------------------------------------------------------------------------------------------------------


def build_and_save(config, device: torch.device, path: Path):
    """Builds the random bf16 model on ``device``, saves it to ``path``; returns it and the two durations."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    start = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # build straight in bf16: no fp32 copy of the weights
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    finally:
        torch.set_default_dtype(previous)
    C.sync(device)
    built = time.perf_counter() - start
    start = time.perf_counter()
    model.save_pretrained(path)
    return model, built, time.perf_counter() - start


def model_shape(arch: str = "llama", tiny: bool = False, layers: Optional[int] = None) -> dict:
    """The config fields of ``arch``'s benchmark model (``TINY``'s sizes for smoke runs)."""
    shape = dict(ARCH_SHAPES[arch])
    if tiny:
        shape.update({k: TINY[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                           "num_key_value_heads", "num_hidden_layers", "vocab_size",
                                           "max_position_embeddings")})  # fmt: skip
        shape.pop("head_dim", None)  # hidden_size / heads, as in TINY
    if layers:
        shape["num_hidden_layers"] = layers
    return shape


def model_config(tiny: bool = False, arch: str = "llama", layers: Optional[int] = None):
    """The benchmark's config of ``arch`` (``TINY`` for smoke runs), bf16."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(MODEL_TYPES.get(arch, arch), **model_shape(arch, tiny, layers))
    config.dtype = torch.bfloat16
    return config


@contextlib.contextmanager
def saved_random_model(config, device: torch.device, prefix: str) -> Iterator[Path]:
    """A temporary directory holding the random model of ``config`` (built on ``device``, saved, and freed from the
    device again, so that every provider loads it from disk); deleted on exit."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        model, _, _ = build_and_save(config, device, Path(tmp))
        del model
        C.free_memory(device)
        yield Path(tmp)


def bnb_config(quant: str):
    from transformers import BitsAndBytesConfig

    if quant == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                              bnb_4bit_use_double_quant=quant == "nf4-dq")  # fmt: skip


def load_model(path: Path, quant: Optional[str], device: torch.device):
    from transformers import AutoModelForCausalLM

    kwargs = dict(dtype=torch.bfloat16)
    if device.type == "cuda":
        kwargs["device_map"] = {"": device.index or 0}
    if quant is not None:
        kwargs["quantization_config"] = bnb_config(quant)
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def provider_fields(provider: str) -> dict:
    """The columns that name a provider in every CSV row: provider, quant ("bf16" for the unquantized model), tuner."""
    quant, tuner = PROVIDERS[provider]
    return dict(provider=provider, quant=quant or "bf16", tuner=tuner)


def wrap(model, provider: str, args):
    """``get_peft_model`` with LoRA (``peft-*``, ``bf16-lora``) or FastLoRA; returns it and its FastLoRA layer count."""
    from peft import LoraConfig, get_peft_model

    import peft_fastlora

    _, tuner = PROVIDERS[provider]
    common = dict(r=RANK, lora_alpha=2 * RANK, lora_dropout=args.lora_dropout, target_modules="all-linear",
                  task_type="CAUSAL_LM")  # fmt: skip
    if tuner == "fastlora" or tuner in FAST_PATH_OPTIONS:
        extra = {"adapter_dtype": "bf16"} if args.adapter_dtype == "bf16" else {}
        model = get_peft_model(model, peft_fastlora.FastLoraConfig(**common, **extra))
        if tuner in FAST_PATH_OPTIONS:
            options = {**FAST_PATH_OPTIONS[tuner], "recompute_last_block": args.recompute_last_block}
            report = peft_fastlora.enable_fast_path(model, **options)
            print(f"  {provider}: {report.summary()}", flush=True)
    else:
        model = get_peft_model(model, LoraConfig(**common))
        if args.adapter_dtype == "bf16":
            for param in model.parameters():
                if param.requires_grad:
                    param.data = param.data.to(torch.bfloat16)
    from peft_fastlora.layer import FastLoraLayer

    n_fast = sum(isinstance(m, FastLoraLayer) for m in model.modules())  # the layers, not the FastLoraModel tuner
    if tuner != "peft" and n_fast == 0:
        raise RuntimeError("FastLoraConfig created no FastLoRA layer: the bitsandbytes layers were not dispatched")
    return model, n_fast


def adapter_dtypes(model) -> str:
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters() if p.requires_grad})
    return "/".join(dtypes)


def set_checkpointing(model, on: bool, reentrant: bool = False) -> None:
    """Non-reentrant gradient (activation) checkpointing on or off; transformers 5.2x renamed the methods."""
    base = model.get_base_model()
    if hasattr(base, "activation_checkpointing_enable"):
        if on:
            base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        else:
            base.activation_checkpointing_disable()
    elif on:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        base.gradient_checkpointing_disable()


# ---- measuring ---------------------------------------------------------------------------------------------------


def train_step(model, optimizer, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def make_step(model, optimizer, ids: torch.Tensor, device: torch.device, graphed: bool):
    """``(step, graph)``: a call running one training step on ``ids``, eager ([`train_step`]) or (``graphed``) a
    replay of a ``GraphedTrainStep`` recorded here, which is ``graph`` (else None; the caller releases it)."""
    if not graphed:
        return functools.partial(train_step, model, optimizer, ids, device), None
    from peft_fastlora import GraphedTrainStep

    inputs = {"input_ids": ids, "labels": ids}
    graph = GraphedTrainStep(model, optimizer, inputs, autocast_dtype=torch.bfloat16)
    return functools.partial(graph, inputs), graph


def run_training(model, batch: int, ckpt: bool, args, device: torch.device, vocab: int, progress,
                 graphed: bool = False) -> dict:
    """Times ``train_step`` (or, ``graphed``, a ``GraphedTrainStep`` of the same step: its recording, warm-up
    included, happens before the timed steps and counts towards the peak memory)."""
    set_checkpointing(model, ckpt, args.reentrant)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(3, vocab, (batch, args.seq), device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    step, graph = make_step(model, optimizer, ids, device, graphed)
    times, host, loss = [], [], None
    try:
        for i in range(args.warmup_steps + args.steps):
            C.sync(device)
            start = time.perf_counter()
            loss = step()
            queued = time.perf_counter()
            C.sync(device)
            if i >= args.warmup_steps:
                times.append(time.perf_counter() - start)
                host.append(queued - start)
            progress.update(1)
    finally:
        if graph is not None:
            graph.release()
        optimizer.zero_grad(set_to_none=True)
        del optimizer, graph, step
    step_s = statistics.median(times)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    # host_ms: until the step's last launch was queued (syncs inside the step included); close to median_step_ms
    # means the host, not the GPU, set the pace.
    return dict(median_step_ms=step_s * 1e3, host_ms=statistics.median(host) * 1e3,
                tokens_per_s=batch * args.seq / step_s, peak_GiB=peak, loss=float(loss))  # fmt: skip


def prepare_generation(model, args, device: torch.device, vocab: int) -> Callable[[], int]:
    """Puts ``model`` in eval mode and warms it up; returns a greedy generate of ``--gen-tokens`` (-> new tokens)."""
    set_checkpointing(model, False)
    model.eval()
    prompt = torch.randint(3, vocab, (1, args.prompt_len), device=device)
    mask = torch.ones_like(prompt)

    def generate() -> int:
        out = model.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=args.gen_tokens,
                             min_new_tokens=args.gen_tokens, do_sample=False, pad_token_id=0)  # fmt: skip
        return out.shape[1] - prompt.shape[1]

    # Warm up with the full length: every new KV length can pick (and, for cuDNN attention, build) new kernels, and a
    # short warm-up left that cost in the first provider's timed run.
    generate()
    return generate


def timed_generate(generate: Callable[[], int], device: torch.device) -> tuple[int, float]:
    """(new tokens, seconds) of one generate, synchronized on both sides."""
    C.sync(device)
    start = time.perf_counter()
    new = generate()
    C.sync(device)
    return new, time.perf_counter() - start


def round_order(providers: list[str], round_index: int) -> list[str]:
    """Round i runs the providers from i mod P on, wrapping around: every provider takes every position in turn, so
    the slow first generate of a round or a drift within one is spread over all providers instead of hitting one."""
    k = round_index % len(providers) if providers else 0
    return providers[k:] + providers[:k]


def same_round_ratios(rates: list[Optional[float]], base: list[Optional[float]]) -> list[float]:
    """``rates[i] / base[i]`` for every round i that both ran (both lists start at round 0): the two generates ran
    seconds apart, so the host's drift over the run cancels out of the ratio."""
    return [r / b for r, b in zip(rates, base) if r is not None and b]


def _spread(values: list[float]) -> tuple[Optional[float], Optional[float], Optional[float]]:
    """(median, min, max), or Nones for no values."""
    return (statistics.median(values), min(values), max(values)) if values else (None, None, None)


def gen_summary(results: list[tuple[int, float]]) -> dict:
    """Median and min/max tokens/s over the rounds of one provider; ``results`` holds (new tokens, seconds) a round."""
    rates = [new / seconds for new, seconds in results]
    median, low, high = _spread(rates)
    return dict(new_tokens=results[-1][0], repeats=len(results), seconds=statistics.median(s for _, s in results),
                tokens_per_s=median, tokens_per_s_min=low, tokens_per_s_max=high,
                round_tokens_per_s=";".join(f"{r:.6g}" for r in rates))  # fmt: skip


def round_rates(row: Optional[dict]) -> list[Optional[float]]:
    """The per-round tokens/s of a generation row (a one-round run reads back from the CSV as a number)."""
    value = None if row is None else row.get("round_tokens_per_s")
    if value is None or value == "":
        return []
    return [float(v) if v else None for v in str(value).split(";")]


def run_profile(model, provider: str, batch: int, ckpt: bool, args, device: torch.device, vocab: int,
                out: Path) -> Path:
    """One profiled training step (after one warm-up step); writes where the GPU idled, the top ``--profile-rows``
    kernels and operators, and (eager steps) the operators grouped by input shapes, which tells the matmuls apart."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    set_checkpointing(model, ckpt, args.reentrant)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(3, vocab, (batch, args.seq), device=device)
    # the recorded step's replay is profiled for a graphed provider
    step, graph = make_step(model, optimizer, ids, device, PROVIDERS[provider][1] in GRAPHED_TUNERS)
    replayed = graph is not None
    try:
        step()
        C.sync(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities, record_shapes=not replayed) as prof:
            step()
            C.sync(device)
    finally:
        if graph is not None:
            graph.release()
        optimizer.zero_grad(set_to_none=True)
        del optimizer, graph, step
    kernels: dict[str, list] = {}
    for evt in prof.events():
        if evt.device_type == DeviceType.CUDA:
            entry = kernels.setdefault(evt.name, [0.0, 0])
            entry[0] += evt.time_range.elapsed_us()
            entry[1] += 1
    total_us = sum(v[0] for v in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[: args.profile_rows]
    rows = [dict(rank=i + 1, kernel=name[:110], calls=n, total_ms=us / 1e3, pct_gpu_time=100 * us / total_us)
            for i, (name, (us, n)) in enumerate(top)]  # fmt: skip
    tag = f"{provider}_b{batch}_ckpt-{'on' if ckpt else 'off'}"
    lines = [f"# {line}" for line in C.header_lines(C.env_info(device))]
    launches = sum(v[1] for v in kernels.values())
    lines.append(f"# profile of one training step: {tag}, seq {args.seq}; GPU kernel time {total_us / 1e3:.2f} ms "
                 f"in {launches} kernels")
    lines += C.timeline_lines(prof.events())
    if rows:
        lines.append(C.format_table(rows, ["rank", "kernel", "calls", "total_ms", "pct_gpu_time"],
                                    f"top-{args.profile_rows} CUDA kernels by total GPU time"))  # fmt: skip
    sort_keys = ("self_cuda_time_total", "self_device_time_total") if device.type == "cuda" else ()
    for key in (*sort_keys, "self_cpu_time_total"):
        try:
            lines += ["", f"operators by {key}:", prof.key_averages().table(sort_by=key, row_limit=args.profile_rows)]
            if not replayed:  # a replay has no operators, an eager step's are told apart by their shapes
                table = prof.key_averages(group_by_input_shape=True).table(sort_by=key, row_limit=args.profile_rows)
                lines += ["", f"operators by input shapes, by {key}:", table]
            break
        except Exception:
            continue
    path = out / f"profile_{tag}.txt"
    path.write_text("\n".join(lines) + "\n")
    if rows:
        C.CsvLog(out / f"profile_{tag}.csv", list(rows[0]), C.env_info(device)).rewrite(rows)
    return path


# ---- derived columns, targets, output ----------------------------------------------------------------------------


def derive(rows: list[dict], gen_rows: list[dict]) -> None:
    """Fills the ratio columns (this run's rows only)."""
    for row in rows:
        if row.get("status") != "ok":
            continue
        key = dict(batch=row["batch"], ckpt=row["ckpt"], seq=row["seq"])
        bf16 = C.find_row(rows, provider="bf16-lora", **key)
        twin = C.find_row(rows, provider=PEFT_TWIN.get(row["provider"]), **key)
        row["ratio_to_bf16"] = C.ratio(row["tokens_per_s"], bf16 and bf16["tokens_per_s"])
        row["ratio_to_peft_bnb"] = C.ratio(row["tokens_per_s"], twin and twin["tokens_per_s"])
        row["peak_vs_peft_bnb"] = C.ratio(row.get("peak_GiB"), twin and twin.get("peak_GiB"))
        unsloth = C.find_row(rows, provider="unsloth-nf4", **key)
        row["ratio_to_unsloth"] = C.ratio(row["tokens_per_s"], unsloth and unsloth["tokens_per_s"])
        row["peak_vs_unsloth"] = C.ratio(row.get("peak_GiB"), unsloth and unsloth.get("peak_GiB"))
    for row in gen_rows:
        if row.get("status") != "ok":
            continue
        bf16 = C.find_row(gen_rows, provider="bf16-lora")
        twin = C.find_row(gen_rows, provider=PEFT_TWIN.get(row["provider"]))
        row["ratio_to_bf16"] = C.ratio(row["tokens_per_s"], bf16 and bf16["tokens_per_s"])
        row["ratio_to_peft_bnb"] = C.ratio(row["tokens_per_s"], twin and twin["tokens_per_s"])
        unsloth = C.find_row(gen_rows, provider="unsloth-nf4")
        row["ratio_to_unsloth"] = C.ratio(row["tokens_per_s"], unsloth and unsloth["tokens_per_s"])
        ratios = same_round_ratios(round_rates(row), round_rates(bf16))
        (row["ratio_to_bf16_round_median"], row["ratio_to_bf16_round_min"],
         row["ratio_to_bf16_round_max"]) = _spread(ratios)  # fmt: skip


def train_targets(rows: list[dict], gen_rows: list[dict]) -> list[C.Check]:
    """The whole-step targets: plain FastLoRA >= bf16 LoRA; the fast path >= 1.10x Unsloth's tokens/s at no more than
    its peak memory; FastLoRA generation >= bf16 LoRA's. Rows that did not run read N/A."""
    checks = []
    configs = list(dict.fromkeys((r["batch"], r["ckpt"]) for r in rows))
    for provider in ("fastlora-nf4", "fastlora-nf4-dq", "fastlora-int8"):
        for batch, ckpt in configs:
            row = C.find_row(rows, provider=provider, batch=batch, ckpt=ckpt)
            checks.append(C.Check(f"train tokens/s: {provider} / bf16-lora", f"batch {batch}, ckpt {ckpt}",
                                  row and row.get("ratio_to_bf16"), ">=", 1.0))  # fmt: skip
    for provider in ("fastpath-nf4", "fastpath-graph-nf4", "fastlora-liger-nf4"):
        for batch, ckpt in configs:
            row = C.find_row(rows, provider=provider, batch=batch, ckpt=ckpt) or {}
            case = f"batch {batch}, ckpt {ckpt}"
            checks.append(C.Check(f"train tokens/s: {provider} / unsloth-nf4", case, row.get("ratio_to_unsloth"),
                                  ">=", 1.10))  # fmt: skip
            checks.append(C.Check(f"peak memory: {provider} / unsloth-nf4", case, row.get("peak_vs_unsloth"),
                                  "<=", 1.0))  # fmt: skip
    for provider in ("fastlora-nf4", "fastlora-int8"):
        row = C.find_row(gen_rows, provider=provider) or {}
        # In one process the providers' rounds interleave, and the median of the same-round ratios cancels the host
        # drift that moved the baselines 1.4x between runs; one process per provider has only the ratio of medians.
        value = row.get("ratio_to_bf16_round_median")
        note = (f"same-round ratio: median of {row.get('repeats')} rounds, range "
                f"{C.fmt(row.get('ratio_to_bf16_round_min'))}-{C.fmt(row.get('ratio_to_bf16_round_max'))}")  # fmt: skip
        if value is None:
            value = row.get("ratio_to_bf16")
            note = "" if value is None else "ratio of the medians"
        checks.append(C.Check(f"generation tokens/s: {provider} / bf16-lora", "batch 1", value, ">=", 1.0, note))
    return checks


def print_tables(rows: list[dict], gen_rows: list[dict]) -> None:
    if rows:
        C.print_table(sorted(rows, key=lambda r: (r["batch"], r["ckpt"])),
                      ["batch", "ckpt", "provider", "adapter_dtype", "median_step_ms", "host_ms", "tokens_per_s",
                       "ratio_to_bf16", "ratio_to_peft_bnb", "ratio_to_unsloth", "peak_GiB", "peak_vs_peft_bnb",
                       "peak_vs_unsloth", "loss", "status"],
                      "== training step (ratios: this run only) ==")
    if gen_rows:
        C.print_table(gen_rows, ["provider", "new_tokens", "repeats", "tokens_per_s", "tokens_per_s_min",
                                 "tokens_per_s_max", "ratio_to_bf16", "ratio_to_bf16_round_median",
                                 "ratio_to_bf16_round_min", "ratio_to_bf16_round_max", "ratio_to_peft_bnb",
                                 "ratio_to_unsloth", "status", "error"],
                      "== greedy generation, batch 1, providers interleaved round by round (tokens_per_s: median of "
                      "the rounds; ratio_to_bf16: of the medians; *_round_*: same-round ratios) ==")  # fmt: skip


def plot_all(rows: list[dict], gen_rows: list[dict], out: Path, env: dict) -> None:
    import matplotlib.pyplot as plt

    providers = [p for p in PROVIDERS if any(r.get("provider") == p for r in rows + gen_rows)]
    configs = list(dict.fromkeys((r["batch"], r["ckpt"]) for r in rows))
    groups = [f"b{b} ckpt {c}" for b, c in configs]
    panels = 3 if gen_rows else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
    seq = rows[0]["seq"] if rows else "?"
    for ax, column, label, title in (
        (axes[0][0], "tokens_per_s", "tokens/s (higher is better)", f"training step, seq {seq}: throughput"),
        (axes[0][1], "peak_GiB", "GiB (lower is better)", f"training step, seq {seq}: peak memory allocated"),
    ):
        series = {p: [(C.find_row(rows, provider=p, batch=b, ckpt=c) or {}).get(column) for b, c in configs]
                  for p in providers}  # fmt: skip
        C.grouped_bars(ax, groups, series, label, title, colors=COLORS)
    axes[0][0].legend(fontsize=7)
    if gen_rows:
        gen = [p for p in providers if C.find_row(gen_rows, provider=p)]
        C.grouped_bars(axes[0][2], ["generation"], {p: [C.find_row(gen_rows, provider=p)["tokens_per_s"]] for p in gen},
                       "new tokens/s", "greedy generation, batch 1", colors=COLORS)
        axes[0][2].legend(fontsize=7)
    C.save_figure(fig, out / "train_step.png", env)


def finalize(rows, gen_rows, out, env, log=None, gen_log=None) -> None:
    steps = [
        ("ratios", lambda: derive(rows, gen_rows)),
        ("csv", lambda: (log.rewrite(rows), gen_log.rewrite(gen_rows)) if log else None),
        ("tables", lambda: print_tables(rows, gen_rows)),
        ("targets", lambda: C.write_targets(train_targets(rows, gen_rows), out / "train_targets.csv", env,
                                            "== targets (end-to-end issue) ==")),
        ("plots", lambda: plot_all(rows, gen_rows, out, env)),
    ]
    C.run_finalize_steps(steps)


# ---- one process per provider ------------------------------------------------------------------------------------

UNSLOTH_SCRIPT = Path(__file__).with_name("unsloth_step.py")
# Options the parent sets for each child (option -> takes a value).
_CHILD_OPTIONS = {"--providers": True, "--gen-providers": True, "--out": True, "--model-dir": True,
                  "--keep-model": False, "--no-gen": False, "--in-process": False, "--profile": True}  # fmt: skip


def child_argv(argv: list[str]) -> list[str]:
    """``argv`` without the options that the parent sets per child."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _CHILD_OPTIONS:
            skip = _CHILD_OPTIONS[name] and "=" not in arg
            continue
        kept.append(arg)
    return kept


def run_child(provider: str, argv: list[str], out: Path, model_dir: Path, generate: bool, profile: bool) -> None:
    cmd = [sys.executable, str(Path(__file__).resolve()), *child_argv(argv), "--in-process", "--providers", provider,
           "--out", str(out), "--model-dir", str(model_dir), "--keep-model"]  # fmt: skip
    cmd += ["--gen-providers", provider] if generate else ["--no-gen"]
    cmd += ["--profile", provider] if profile else []
    print(f"\n== {provider}: its own process ==", flush=True)
    subprocess.run(cmd, check=False)


def run_unsloth(args, out: Path, generate: bool) -> tuple[list[dict], list[dict]]:
    """Unsloth's step in its own process (it patches transformers and PEFT on import); its rows in our columns."""
    gc_modes = {"off": "False", "on": "unsloth"}
    env = dict(os.environ, LAYERS=str(args.layers or LLAMA3_8B_8_LAYERS["num_hidden_layers"]),
               BATCH=",".join(map(str, args.batches)), STEPS=str(args.steps), OUT=str(out),
               GC=",".join(gc_modes[c] for c in args.ckpts), GEN="1" if generate else "0",
               GEN_REPEATS=str(args.gen_repeats), LORA_BF16="1")  # fmt: skip
    print("\n== unsloth-nf4: its own process ==", flush=True)
    subprocess.run([sys.executable, str(UNSLOTH_SCRIPT)], env=env, check=False)
    path = out / "unsloth.json"
    found = json.loads(path.read_text()) if path.exists() else []
    base = dict(provider_fields("unsloth-nf4"), seq=2048, steps=args.steps, adapter_dtype="bfloat16")
    rows, gen_rows = [], []
    for r in found:
        if r.get("phase") == "gen":
            ok = "gen_tok_s" in r
            gen_rows.append(dict(provider_fields("unsloth-nf4"), prompt=64, new_tokens=128, repeats=args.gen_repeats,
                                 seconds=r.get("gen_s"), tokens_per_s=r.get("gen_tok_s"),
                                 status="ok" if ok else "error", error=None if ok else r.get("error")))  # fmt: skip
            continue
        ok = "tok_s" in r
        rows.append(dict(base, batch=r["batch"], ckpt="off" if r["grad_ckpt"] in (0, False, "0") else "on",
                         tokens_per_s=r.get("tok_s"), median_step_ms=r["step_s"] * 1e3 if ok else None,
                         peak_GiB=r.get("peak_gib"), loss=r.get("loss"), status="ok" if ok else "error",
                         error=None if ok else r.get("error")))  # fmt: skip
    if not found:
        rows = [dict(base, batch=b, ckpt=c, status="error", error="unsloth_step.py wrote no rows")
                for b in args.batches for c in args.ckpts]  # fmt: skip
    return rows, gen_rows


def _rows_if_any(path: Path) -> list[dict]:
    """The rows of a child's CSV; none if the child died before writing it."""
    return C.read_csv(path) if path.exists() else []


def run_isolated(args, argv: list[str], providers: list[str], gen_providers: list[str],
                 profile: list[str]) -> int:  # fmt: skip
    """Each provider in its own process, one after the other; then the merged tables, targets and plots."""
    out: Path = args.out
    model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="fastlora-bench-model-"))
    rows, gen_rows = [], []
    try:
        for provider in providers:
            child_out = out / "providers" / provider
            generate = provider in gen_providers
            if PROVIDERS[provider][1] == "unsloth":
                child_rows, child_gen = run_unsloth(args, child_out, generate)
            else:
                run_child(provider, argv, child_out, model_dir, generate, provider in profile)
                child_rows = _rows_if_any(child_out / "train_step.csv")
                child_gen = _rows_if_any(child_out / "generation.csv")
            rows += child_rows
            gen_rows += child_gen
    finally:
        if args.model_dir is None and not args.keep_model:
            shutil.rmtree(model_dir, ignore_errors=True)
    device = C.pick_device(args.device)
    env = C.env_info(device)
    env["run"] = f"bench_train_step (one process per provider) {' '.join(argv)}"
    finalize(rows, gen_rows, out, env, C.CsvLog(out / "train_step.csv", TRAIN_COLUMNS, env),
             C.CsvLog(out / "generation.csv", GEN_COLUMNS, env))  # fmt: skip
    return 0


# ---- main --------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output directory")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny 2-layer model, seq 32, few steps: CI smoke run")
    p.add_argument("--quick", action="store_true", help="batch 1 only, 2 warm-up + 3 timed steps")
    p.add_argument("--providers", help=f"comma-separated subset of {list(PROVIDERS)}")
    p.add_argument("--batches", help="comma-separated batch sizes (default 1,4; quick 1)")
    p.add_argument("--ckpt", default="both", choices=["both", "off", "on"], help="gradient checkpointing")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; tiny 32)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 8)")
    p.add_argument("--arch", default="llama", choices=list(ARCH_SHAPES),
                   help="model architecture: 8 layers of Llama-3-8B (default), Qwen2-7B or Mistral-7B, or the whole "
                   "Llama-3.2-1B (llama-1b)")
    p.add_argument("--warmup-steps", type=int, default=None, help="default 3 (quick 2, tiny 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 5; quick 3, tiny 2)")
    p.add_argument("--gen-tokens", type=int, default=None, help="new tokens for generation (default 128; tiny 8)")
    p.add_argument("--prompt-len", type=int, default=None, help="generation prompt length (default 32; tiny 4)")
    p.add_argument("--gen-repeats", type=int, default=5,
                   help="interleaved rounds of timed generates, one per provider a round; median (default 5)")
    p.add_argument("--gen-providers", default=",".join(GEN_PROVIDERS), help="providers to time generation for")
    p.add_argument("--no-gen", action="store_true", help="skip generation")
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--reentrant", action="store_true", help="reentrant gradient checkpointing (default: non-reentrant)")
    p.add_argument("--recompute-last-block", action="store_true",
                   help="fast-path providers: checkpoint the last decoder block too (enable_fast_path's "
                        "recompute_last_block=True; default: its activations are kept)")
    p.add_argument("--adapter-dtype", default="default", choices=["default", "bf16"],
                   help="default: what get_peft_model gives (PEFT upcasts its adapters to fp32, FastLoRA follows "
                        "its adapter_dtype policy: bf16 here); bf16: bf16 adapters for every provider")
    p.add_argument("--profile", help="comma-separated providers to profile one training step of (top kernels)")
    p.add_argument("--profile-batch", type=int, default=1)
    p.add_argument("--profile-rows", type=int, default=20, help="kernels and operators listed per profile table")
    p.add_argument("--profile-ckpt", default="off", choices=["off", "on"])
    p.add_argument("--model-dir", type=Path, help="where the random model is saved (reused if it holds one)")
    p.add_argument("--keep-model", action="store_true", help="do not delete --model-dir at the end")
    p.add_argument("--budget-s", type=float, default=None, help="soft time budget: later work is recorded as skipped")
    p.add_argument("--gen-reserve-s", type=float, default=None,
                   help="seconds of --budget-s kept for the generation phase: training stops that much earlier "
                        "(default: an estimate for the full-size model on an H100/H200; 0 with --tiny or --no-gen)")
    p.add_argument("--in-process", action="store_true",
                   help="run every provider in this process (default: each provider in its own process, the only way "
                        "peak memory compares: a model leaves memory behind for the next one in the same process)")
    p.add_argument("--replot", action="store_true", help="only re-read the CSVs in --out and redo tables/targets/plots")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    return p


def _defaults(args) -> None:
    tiny, quick = args.tiny, args.quick
    args.seq = args.seq or (32 if tiny else 2048)
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (1 if tiny else 2 if quick else 3)
    args.steps = args.steps or (2 if tiny else 3 if quick else 5)
    args.gen_tokens = args.gen_tokens or (8 if tiny else 128)
    args.prompt_len = args.prompt_len or (4 if tiny else 32)
    if args.gen_repeats < 1:
        raise SystemExit(f"bench_train_step.py: error: --gen-repeats must be >= 1, got {args.gen_repeats}")
    if args.gen_reserve_s is None:
        # Generation runs after all training, so a run whose training fills the budget would skip every generate.
        # Estimate: ~5 s to load and wrap a model, ~2.5 s a 128-token generate (27-85 tokens/s), warm-up included.
        n = 0 if args.no_gen or args.tiny else len(C.parse_csv_arg(args.gen_providers) or [])
        args.gen_reserve_s = n * (5 + 2.5 * args.gen_tokens / 128 * (args.gen_repeats + 1))
    batches = C.parse_csv_arg(args.batches)
    args.batches = [int(b) for b in batches] if batches else ([1, 2] if tiny else [1] if quick else [1, 4])
    args.ckpts = {"both": ["off", "on"], "off": ["off"], "on": ["on"]}[args.ckpt]


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        rows, gen_rows = C.read_csv(out / "train_step.csv"), C.read_csv(out / "generation.csv")
        finalize(rows, gen_rows, out, C.read_csv_header(out / "train_step.csv"))
        return 0
    _defaults(args)
    device = C.pick_device(args.device)
    providers = C.parse_csv_arg(args.providers) or list(DEFAULT_PROVIDERS)
    profile = C.parse_csv_arg(args.profile) or []
    gen_providers = [] if args.no_gen else C.parse_csv_arg(args.gen_providers)
    unknown = [p for p in providers + profile + gen_providers if p not in PROVIDERS]
    if unknown:
        raise SystemExit(f"unknown provider(s) {unknown}; choose from {list(PROVIDERS)}")
    providers = [p for p in PROVIDERS if p in providers or p in profile]
    if args.arch != "llama" and "unsloth-nf4" in providers:
        raise SystemExit(f"unsloth-nf4 runs the Llama model only (benchmarks/unsloth_step.py); --arch {args.arch} "
                         "needs --providers without it")  # fmt: skip
    # Unsloth always runs through the isolated runner (its own script, its own process), even as the only provider.
    if not args.in_process and (len(providers) > 1 or "unsloth-nf4" in providers):
        return run_isolated(args, list(sys.argv[1:] if argv is None else argv), providers,
                            [p for p in gen_providers if p in providers], profile)  # fmt: skip
    if "unsloth-nf4" in providers:
        raise SystemExit("unsloth-nf4 runs only in its own process: leave out --in-process")

    import bitsandbytes  # noqa: F401  (import everything before gc.freeze)
    import peft  # noqa: F401
    import transformers
    from tqdm.auto import tqdm

    import peft_fastlora  # noqa: F401

    C.setup_run()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars would bury the table in the log
    shape = model_shape(args.arch, args.tiny, args.layers)
    config = model_config(args.tiny, args.arch, args.layers)
    env = C.env_info(device)
    env["run"] = (f"bench_train_step arch={args.arch} model={shape} seq={args.seq} batches={args.batches} "
                  f"ckpt={args.ckpts} "
                  f"providers={providers} r={RANK} all-linear dropout={args.lora_dropout} "
                  f"adapters={args.adapter_dtype} "
                  f"warmup_steps={args.warmup_steps} steps={args.steps} gen={gen_providers} "
                  f"gen_tokens={args.gen_tokens} gen_repeats={args.gen_repeats} (interleaved rounds) "
                  f"budget_s={args.budget_s} gen_reserve_s={C.fmt(args.gen_reserve_s)}")  # fmt: skip
    C.print_header(f"bench_train_step: {ARCH_NAMES[args.arch]}-shaped model, LoRA training + generation "
                   "(ratios within THIS run)", env)  # fmt: skip
    log = C.CsvLog(out / "train_step.csv", TRAIN_COLUMNS, env)
    gen_log = C.CsvLog(out / "generation.csv", GEN_COLUMNS, env)
    setup_log = C.CsvLog(out / "setup.csv", SETUP_COLUMNS, env)
    rows: list[dict] = []
    gen_rows: list[dict] = []
    deadline = C.Deadline(args.budget_s)
    # Training and profiling stop --gen-reserve-s before the end of the budget: the generation phase comes after them.
    train_deadline = C.Deadline(None if args.budget_s is None else max(args.budget_s - args.gen_reserve_s, 0.0))
    configs = [(b, c) for b in args.batches for c in args.ckpts]
    train_providers = [p for p in providers if p in (C.parse_csv_arg(args.providers) or DEFAULT_PROVIDERS)]
    total = len(train_providers) * len(configs) * (args.warmup_steps + args.steps)
    progress = tqdm(total=total, desc="train steps", unit="step", file=sys.stderr,
                    mininterval=2.0 if sys.stderr.isatty() else 20.0)  # a log file gets a line every 20 s

    def note(step, provider, seconds, text=""):
        row = dict(step=step, provider=provider, seconds=seconds, note=text)
        setup_log.append(row)
        progress.write(f"  {step} {provider}: {C.fmt(seconds)} s {text}")

    def record_train(row):
        derive(rows + [row], [])
        rows.append(row)
        log.append(row)
        progress.write(f"  train {row['provider']:16s} batch {row['batch']} ckpt {row['ckpt']:3s} "
                       f"{C.fmt(row.get('tokens_per_s'), 4):>8} tok/s  {C.fmt(row.get('peak_GiB'))} GiB  "
                       f"x{C.fmt(row.get('ratio_to_bf16'))} bf16  {row['status']} {row.get('error') or ''}")

    def record_gen(row):
        derive([], gen_rows + [row])
        gen_rows.append(row)
        gen_log.append(row)
        numbers = "" if row["status"] != "ok" else (
            f"{C.fmt(row['tokens_per_s'], 4)} tok/s (median of {row['repeats']}, {C.fmt(row['tokens_per_s_min'], 4)}-"
            f"{C.fmt(row['tokens_per_s_max'], 4)})  x{C.fmt(row.get('ratio_to_bf16'))} bf16, same-round "
            f"x{C.fmt(row.get('ratio_to_bf16_round_median'))}  ")  # fmt: skip
        progress.write(f"  generate {row['provider']:16s} {numbers}{row['status']} {row.get('error') or ''}")

    model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="fastlora-bench-model-"))
    temporary = args.model_dir is None and not args.keep_model
    built: dict = {}  # {"model": the bf16 model just built}, handed to the bf16-lora provider

    def fail_provider(provider: str, base_row: dict, status: str, error: str) -> None:
        """Records every remaining training row of ``provider`` as failed or skipped."""
        done = {(r["batch"], r["ckpt"]) for r in rows if r["provider"] == provider}
        for batch, ckpt in configs if provider in train_providers else []:
            if (batch, ckpt) not in done:
                record_train(dict(base_row, batch=batch, ckpt=ckpt, status=status, error=error))
                progress.update(args.warmup_steps + args.steps)

    def run_provider(provider: str, base_row: dict) -> None:
        quant, _ = PROVIDERS[provider]
        start = time.perf_counter()
        reused = quant is None and "model" in built
        model = built.pop("model") if reused else load_model(model_dir, quant, device)
        load_s = time.perf_counter() - start
        note("load", provider, load_s, "(the model just built, in memory)" if reused else "(from_pretrained)")
        model, n_fast = wrap(model, provider, args)
        C.free_memory(device)
        resident = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
        base_row.update(load_s=load_s, fastlora_layers=n_fast, adapter_dtype=adapter_dtypes(model),
                        resident_GiB=resident)  # fmt: skip
        for batch, ckpt in configs if provider in train_providers else []:
            row = dict(base_row, batch=batch, ckpt=ckpt)
            if train_deadline.expired():
                row.update(status="skipped", error="time budget")
                progress.update(args.warmup_steps + args.steps)
            else:
                progress.set_postfix_str(f"{provider} b{batch} ckpt {ckpt}")
                try:
                    graphed = PROVIDERS[provider][1] in GRAPHED_TUNERS
                    row.update(run_training(model, batch, ckpt == "on", args, device, config.vocab_size, progress,
                                            graphed), status="ok")  # fmt: skip
                except Exception as err:
                    if args.verbose:
                        traceback.print_exc()
                    row.update(status="oom" if C.is_oom(err) else "error", error=C.short_error(err))
                C.free_memory(device)
            record_train(row)
        if provider in profile and not train_deadline.expired():
            try:
                path = run_profile(model, provider, args.profile_batch, args.profile_ckpt == "on", args, device,
                                   config.vocab_size, out)  # fmt: skip
                progress.write(f"  wrote {path}")
            except Exception as err:
                progress.write(f"  !! profile {provider} failed: {C.short_error(err)}")
            C.free_memory(device)

    def gen_row(provider: str, **fields) -> dict:
        return dict(provider_fields(provider), prompt=args.prompt_len, **fields)

    def load_for_generation(provider: str) -> Optional[Callable[[], int]]:
        """Loads, wraps and warms up ``provider``; None, with its row recorded, if that failed or the budget is spent.

        A provider whose load or wrap failed in training is loaded again rather than given the training error: the
        generation phase has its own memory state (an OOM there need not repeat), and a failure that does repeat
        costs one load and gets its own error row.
        """
        if setup_error or deadline.expired():
            status, error = ("error", setup_error) if setup_error else ("skipped", "time budget")
            record_gen(gen_row(provider, status=status, error=error))
            return None
        try:
            start = time.perf_counter()
            model = load_model(model_dir, PROVIDERS[provider][0], device)
            note("load", provider, time.perf_counter() - start, "(from_pretrained, for the generation phase)")
            model, _ = wrap(model, provider, args)
            return prepare_generation(model, args, device, config.vocab_size)
        except Exception as err:
            if args.verbose:
                traceback.print_exc()
            record_gen(gen_row(provider, status="oom" if C.is_oom(err) else "error", error=C.short_error(err)))
            return None

    def record_rounds(provider: str, results: list[tuple[int, float]], failure: Optional[tuple[str, str]]) -> None:
        """The row of one loaded provider: its rounds' summary, or why it has none."""
        cut = "time budget" if deadline.expired() else "interrupted"
        if failure:
            record_gen(gen_row(provider, status=failure[0], error=failure[1]))
        elif not results:
            record_gen(gen_row(provider, status="skipped", error=cut))
        else:
            row = gen_row(provider, **gen_summary(results), status="ok")
            if len(results) < args.gen_repeats:
                row["error"] = f"{len(results)} of {args.gen_repeats} rounds ({cut})"
            record_gen(row)

    def run_generation_phase() -> None:
        """Every generation provider resident at once, timed in interleaved rounds (see the module docstring)."""
        generates: dict[str, Callable[[], int]] = {}
        results: dict[str, list[tuple[int, float]]] = {}  # provider -> (new tokens, seconds) of rounds 0, 1, ...
        failures: dict[str, tuple[str, str]] = {}  # provider -> (status, error) of a failed timed generate
        try:
            for provider in gen_providers:
                generate = load_for_generation(provider)
                C.free_memory(device)  # what a failed load left behind
                if generate is not None:
                    generates[provider], results[provider] = generate, []
            loaded = list(generates)
            for i in range(args.gen_repeats if loaded else 0):
                if deadline.expired():  # checked per round only: a round, once started, times every provider
                    break
                done = []
                for provider in round_order(loaded, i):
                    if provider not in generates:
                        continue
                    try:
                        new, seconds = timed_generate(generates[provider], device)
                    except Exception as err:
                        if args.verbose:
                            traceback.print_exc()
                        failures[provider] = ("oom" if C.is_oom(err) else "error", C.short_error(err))
                        del generates[provider]  # its model goes at the next free_memory
                        done.append(f"{provider} failed")
                        continue
                    results[provider].append((new, seconds))
                    done.append(f"{provider} {C.fmt(new / seconds, 4)}")
                progress.write(f"  generate round {i + 1}/{args.gen_repeats} (tokens/s): {', '.join(done)}")
        finally:
            generates.clear()
            C.free_memory(device)
            for provider, provider_results in results.items():
                record_rounds(provider, provider_results, failures.get(provider))
            gen_rows.sort(key=lambda r: gen_providers.index(r["provider"]))

    interrupted = False
    try:
        setup_error = None
        if not (model_dir / "config.json").exists():
            try:
                built["model"], build_s, save_s = build_and_save(config, device, model_dir)
                size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**30
                note("build", "bf16 model", build_s, f"(random init on {device})")
                note("save_pretrained", "bf16 model", save_s, f"({size:.2f} GiB to {model_dir})")
            except Exception as err:
                if args.verbose:
                    traceback.print_exc()
                setup_error = "build/save model: " + C.short_error(err)
            if "bf16-lora" not in providers:  # else it would stay resident and inflate everyone's peak memory
                built.clear()
                C.free_memory(device)
        for provider in providers:
            base_row = dict(provider_fields(provider), seq=args.seq, warmup_steps=args.warmup_steps,
                            steps=args.steps)  # fmt: skip
            if setup_error or train_deadline.expired():
                fail_provider(provider, base_row, "error" if setup_error else "skipped", setup_error or "time budget")
                continue
            try:
                run_provider(provider, base_row)
            except Exception as err:  # load or wrap failed (or anything else): its rows are errors, the run goes on
                if args.verbose:
                    traceback.print_exc()
                fail_provider(provider, base_row, "oom" if C.is_oom(err) else "error", C.short_error(err))
            built.clear()
            C.free_memory(device)
        progress.close()  # its lines would be redrawn under every generation line
        # After all training, so that no other resident model inflated a provider's training peak memory.
        run_generation_phase()
    except KeyboardInterrupt:
        interrupted = True
        progress.write("\n!! interrupted: writing what was measured so far")
    finally:
        progress.close()
        built.clear()
        if temporary:
            shutil.rmtree(model_dir, ignore_errors=True)
    finalize(rows, gen_rows, out, env, log, gen_log)
    print(f"\nbench_train_step {'interrupted' if interrupted else 'done'} after {deadline.elapsed():.0f} s; "
          f"results in {out}", flush=True)
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
