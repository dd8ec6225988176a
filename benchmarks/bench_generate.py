"""Greedy generation with the adapter active on a Llama-3-8B-shaped model (8 decoder layers; ``--arch`` picks another
of ``bench_train_step``'s models), in four modes:
``eager`` (``model.generate``), ``compiled`` (``generate`` with the decode step compiled by
``peft_fastlora.compile_for_generation``: static KV cache, ``torch.compile(mode="reduce-overhead")``), ``graphed``
(``peft_fastlora.graphed_generate``: the prompt and ``--steps-per-graph`` decode steps recorded as CUDA graphs and
replayed) and ``graphed-compiled`` (the same with the one-token forward compiled before it is recorded).

Providers: ``bf16-lora`` (PEFT LoRA, unquantized bf16), ``peft-bnb-nf4`` (PEFT LoRA on bitsandbytes nf4) and
``fastlora-nf4`` (FastLoRA on the same nf4 model), each in every mode of ``--modes``, at the given batch sizes. Every
provider runs in this process one after the other (only speed is compared here; Unsloth's generation, which patches
transformers, is measured by ``bench_train_step.py --providers unsloth-nf4`` in its own process). For the compiled
mode the script reports graph breaks and CUDA-graph skips; the compiled and graphed tokens are compared with the
eager ones (``same_tokens_as_eager``).

GPU:  python benchmarks/bench_generate.py --out benchmarks/results/generate
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import _common as C
import bench_train_step as B
import torch

PROVIDERS = ["bf16-lora", "peft-bnb-nf4", "fastlora-nf4"]  # rows of bench_train_step.PROVIDERS
COLUMNS = ["provider", "mode", "batch", "prompt", "new_tokens", "repeats", "tokens_per_s", "ratio_to_peft_bnb_eager",
           "same_tokens_as_eager", "same_tokens_as_compiled", "graph_breaks", "cudagraph_skips", "status",
           "error"]  # fmt: skip


def wrap(model, provider: str):
    """bench_train_step's LoRA / FastLoRA wrapping with bf16 adapters, made to look trained, in eval mode."""
    model, _ = B.wrap(model, provider, SimpleNamespace(lora_dropout=0.0, adapter_dtype="bf16"))
    with torch.no_grad():  # wide logit margins: random weights make near-ties that flip greedy tokens on rounding
        model.get_base_model().get_output_embeddings().weight.mul_(20)
        for name, param in model.named_parameters():
            if "lora_B" in name:  # a trained-looking adapter: B = 0 would make the LoRA term vanish
                torch.nn.init.normal_(param, std=0.02)
    return model.eval()


def generate(model, prompt, new_tokens: int, mode: str, steps_per_graph: int = 16):
    if mode.startswith("graphed"):
        import peft_fastlora

        return peft_fastlora.graphed_generate(model, prompt, max_new_tokens=new_tokens, ignore_eos=True,
                                              steps_per_graph=steps_per_graph,
                                              compile_step=mode == "graphed-compiled")  # fmt: skip
    static = mode == "compiled"
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                  attention_mask=torch.ones_like(prompt))  # fmt: skip
    if static:
        kwargs["cache_implementation"] = "static"
    with torch.inference_mode():
        return model.generate(input_ids=prompt, **kwargs)


def timed(model, prompt, new_tokens, mode, repeats, steps_per_graph) -> tuple[float, torch.Tensor]:
    rates, out = [], None
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = generate(model, prompt, new_tokens, mode, steps_per_graph)
        torch.cuda.synchronize()
        rates.append(prompt.shape[0] * new_tokens / (time.perf_counter() - start))
    return statistics.median(rates), out


def same_tokens(rows: list[dict], out: torch.Tensor, provider: str, batch: int, mode: str) -> Optional[bool]:
    """Whether ``out`` equals the tokens of the ``mode`` row of the same provider and batch (None without one)."""
    ref = C.find_row(rows, provider=provider, mode=mode, batch=batch)
    return None if ref is None or "tokens" not in ref else bool(torch.equal(ref["tokens"], out.cpu()))


def profile_generate(model, prompt, new_tokens: int, mode: str, path: Path, steps_per_graph: int) -> None:
    """One profiled ``generate``: where the GPU idles (``_common.timeline_lines``) and the top-15 kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate(model, prompt, new_tokens, mode, steps_per_graph)
        torch.cuda.synchronize()
    kernels: dict[str, list] = {}
    for evt in prof.events():
        if evt.device_type == DeviceType.CUDA:
            entry = kernels.setdefault(evt.name[:100], [0.0, 0])
            entry[0] += evt.time_range.elapsed_us()
            entry[1] += 1
    total = sum(v[0] for v in kernels.values())
    lines = [f"# generate of {new_tokens} tokens, batch {prompt.shape[0]}; GPU kernel time {total / 1e3:.2f} ms"]
    lines += C.timeline_lines(prof.events())
    lines.append("top-15 kernels (ms, calls):")
    for name, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:15]:
        lines.append(f"  {us / 1e3:8.3f}  {n:6d}  {name}")
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:8]), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/generate"))
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--modes", default="eager,compiled,graphed,graphed-compiled")
    p.add_argument("--steps-per-graph", type=int, default=16, help="decode steps per graph replay (graphed modes)")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="tiny model (smoke run; still needs CUDA)")
    p.add_argument("--arch", default="llama", choices=list(B.ARCH_SHAPES),
                   help="bench_train_step's models: 8 layers of Llama-3-8B (default), Qwen2-7B, Mistral-7B, or the "
                   "whole Llama-3.2-1B (llama-1b)")  # fmt: skip
    p.add_argument("--profile", action="store_true",
                   help="also profile one generate per row: where the GPU idles and the top kernels")  # fmt: skip
    args = p.parse_args(argv)
    import transformers
    from torch._dynamo.utils import counters

    import peft_fastlora

    transformers.logging.set_verbosity_error()
    device = C.pick_device("cuda")
    env = C.env_info(device)
    env["run"] = "bench_generate " + " ".join(sys.argv[1:] if argv is None else argv)
    log = C.CsvLog(args.out / "generate.csv", COLUMNS, env)
    config = B.model_config(args.tiny, args.arch)
    rows = []
    with B.saved_random_model(config, device, "fastlora-gen-model-") as model_dir:
        for provider in C.parse_csv_arg(args.providers):
            for mode in C.parse_csv_arg(args.modes):
                torch._dynamo.reset()
                counters.clear()
                torch.manual_seed(0)
                model = wrap(B.load_model(model_dir, B.PROVIDERS[provider][0], device), provider)
                if mode == "compiled":
                    peft_fastlora.compile_for_generation(model)
                for batch in map(int, C.parse_csv_arg(args.batches)):
                    row = dict(provider=provider, mode=mode, batch=batch, prompt=args.prompt_len,
                               new_tokens=args.new_tokens, repeats=args.repeats)  # fmt: skip
                    try:
                        torch.manual_seed(batch)
                        prompt = torch.randint(3, config.vocab_size, (batch, args.prompt_len), device=device)
                        spg = args.steps_per_graph
                        generate(model, prompt, args.new_tokens, mode, spg)  # compile / record the graphs
                        generate(model, prompt, args.new_tokens, mode, spg)
                        rate, out = timed(model, prompt, args.new_tokens, mode, args.repeats, spg)
                        row.update(tokens_per_s=rate, status="ok")
                        if mode != "eager":
                            row["same_tokens_as_eager"] = same_tokens(rows, out, provider, batch, "eager")
                        if mode.startswith("graphed"):  # both decode over a static cache
                            row["same_tokens_as_compiled"] = same_tokens(rows, out, provider, batch, "compiled")
                        if mode == "compiled":
                            row["graph_breaks"] = sum(counters["graph_break"].values())
                            row["cudagraph_skips"] = counters["inductor"].get("cudagraph_skips", 0)
                        row["tokens"] = out.cpu()
                        if args.profile:
                            path = args.out / f"profile_{provider}_{mode}_b{batch}.txt"
                            profile_generate(model, prompt, args.new_tokens, mode, path, spg)
                    except Exception as err:
                        row.update(status="oom" if C.is_oom(err) else "error", error=C.short_error(err))
                    rows.append(row)
                    log.append(row)
                    print(f"  {provider:14s} {mode:8s} batch {batch:3d}: {C.fmt(row.get('tokens_per_s'), 4)} tok/s "
                          f"same-tokens={row.get('same_tokens_as_eager')}/{row.get('same_tokens_as_compiled')} "
                          f"breaks={row.get('graph_breaks')} "
                          f"skips={row.get('cudagraph_skips')} {row['status']} {row.get('error') or ''}", flush=True)
                del model
                C.free_memory(device)
    for row in rows:
        base = C.find_row(rows, provider="peft-bnb-nf4", mode="eager", batch=row["batch"])
        row["ratio_to_peft_bnb_eager"] = C.ratio(row.get("tokens_per_s"), base and base["tokens_per_s"])
    log.rewrite(rows)
    C.print_table(rows, [c for c in COLUMNS if c not in ("prompt", "repeats")], "== greedy generation ==")
    return 0


if __name__ == "__main__":
    sys.exit(main())
