"""Smoke tests of the benchmark scripts: tiny shapes on the CPU, same code path as the GPU run.

Each script runs end to end in a subprocess (as a user runs it) and must write its CSVs, with the environment header
and the expected columns, and its PNGs. A provider that fails must become an error row.
"""

import csv
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

# Minutes of subprocesses or whole training runs: `pytest -m 'not slow'` leaves them out while working on the code.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
HEADER_KEYS = ("gpu", "torch", "triton", "transformers", "peft", "bitsandbytes", "date", "command")
TIMEOUT_S = 240  # generous for a loaded 2-core CI box; a normal run takes ~10 s


def _env() -> dict[str, str]:
    """The scripts import the package they measure: this checkout's, as ``benchmarks/run_gpu.sh`` arranges."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def _bench_module(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return __import__(name)


def run_python(args: list[str], out: Path) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=_env())  # fmt: skip
    log = proc.stdout + proc.stderr
    (out / "log.txt").write_text(log)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{log[-4000:]}"
    return log


def read(path: Path) -> tuple[dict[str, str], list[str], list[dict[str, str]]]:
    """(header, columns, rows) of a benchmark CSV."""
    assert path.exists(), f"{path.name} was not written"
    lines = path.read_text().splitlines()
    header = dict(line[2:].split(": ", 1) for line in lines if line.startswith("# "))
    body = [line for line in lines if not line.startswith("#")]
    reader = csv.DictReader(body)
    return header, reader.fieldnames, list(reader)


def check_header(header: dict[str, str]) -> None:
    missing = [k for k in HEADER_KEYS if k not in header]
    assert not missing, f"CSV header lacks {missing}: {header}"


def check_png(path: Path) -> None:
    assert path.exists(), f"{path.name} was not written"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"


def test_bench_layers_tiny_cpu(tmp_path):
    log = run_python(["benchmarks/bench_layers.py", "--device", "cpu", "--tiny", "--out", str(tmp_path)], tmp_path)
    assert "bench_layers done" in log, log[-3000:]

    header, columns, rows = read(tmp_path / "layers.csv")
    check_header(header)
    for col in ("shape", "mode", "M", "provider", "time_ms", "ratio_to_bf16", "speedup_vs_peft_bnb", "status"):
        assert col in columns
    providers = {"bf16-lora", "peft-bnb-nf4", "peft-bnb-nf4-dq", "peft-bnb-int8", "fastlora-nf4", "fastlora-nf4-dq",
                 "fastlora-int8"}  # fmt: skip
    assert {r["provider"] for r in rows} == providers
    assert {r["mode"] for r in rows} == {"train", "infer"} and {r["M"] for r in rows} == {"1", "16"}
    bad = [(r["provider"], r["mode"], r["M"], r["error"]) for r in rows if r["status"] != "ok"]
    assert not bad, f"rows that did not run: {bad}"
    fast = [r for r in rows if r["provider"].startswith("fastlora")]
    assert all(r["layer"].endswith("FastLoraLinear4bit") or r["layer"].endswith("FastLoraLinear8bit") for r in fast)
    assert all(float(r["time_ms"]) > 0 and float(r["ratio_to_bf16"]) > 0 for r in rows)
    assert all(float(r["speedup_vs_peft_bnb"]) > 0 for r in fast)

    _, dq_columns, dq_rows = read(tmp_path / "dequant.csv")
    assert {"variant", "impl", "GBps", "pct_copy"} <= set(dq_columns)
    pairs = {(r["variant"], r["impl"]) for r in dq_rows}
    assert pairs >= {("copy", "copy"), ("nf4", "fastlora"), ("nf4-dq", "bnb"), ("int8", "fastlora")}
    assert all(r["status"] == "ok" and float(r["GBps"]) > 0 for r in dq_rows)

    _, t_columns, targets = read(tmp_path / "layers_targets.csv")
    assert t_columns[:3] == ["target", "case", "value"] and "result" in t_columns
    assert {t["result"] for t in targets} <= {"PASS", "MISS", "N/A"}
    assert any(t["result"] != "N/A" for t in targets)
    check_png(tmp_path / "layers_decode.png")
    check_png(tmp_path / "dequant.png")

    # --replot rebuilds tables, targets and plots from the CSVs alone.
    (tmp_path / "dequant.png").unlink()
    run_python(["benchmarks/bench_layers.py", "--replot", "--out", str(tmp_path)], tmp_path)
    check_png(tmp_path / "dequant.png")


def test_bench_layers_kernels_and_profile_sections_tiny_cpu(tmp_path):
    """The op-level timings and the torch.profiler tables, with fp32 adapters; --replot copes with a missing CSV."""
    args = ["benchmarks/bench_layers.py", "--device", "cpu", "--tiny", "--shapes", "128x64", "--m", "1",
            "--sections", "kernels,profile", "--providers", "bf16-lora,fastlora-nf4", "--adapter-dtype", "fp32",
            "--profile-steps", "2", "--out", str(tmp_path)]  # fmt: skip
    log = run_python(args, tmp_path)
    assert "bench_layers done" in log, log[-3000:]

    header, columns, rows = read(tmp_path / "kernels.csv")
    check_header(header)
    assert {"op", "M", "out_dtype", "impl", "us", "GBps", "speedup_vs_bnb", "status"} <= set(columns)
    cases = {(r["op"], r["impl"], r["out_dtype"], r["M"]) for r in rows}
    assert cases == {("dequant", impl, dtype, "") for impl in ("fastlora-dequant", "bnb-dequant")
                     for dtype in ("bfloat16", "float32")} | {
        ("forward", impl, "bfloat16", "1") for impl in ("fastlora", "fastlora-base", "peft-bnb", "bnb-base")}
    assert all(r["status"] == "ok" and float(r["us"]) > 0 and float(r["GBps"]) > 0 for r in rows), rows
    fast = [r for r in rows if r["impl"].startswith("fastlora")]
    assert all(float(r["speedup_vs_bnb"]) > 0 for r in fast)

    for provider in ("bf16-lora", "fastlora-nf4"):
        text = (tmp_path / f"profile_{provider}_128x64_M1_train.txt").read_text()
        assert text.startswith("# gpu: ") and "aten::" in text and "2 training calls" in text
    _, _, layer_rows = read(tmp_path / "layers.csv")
    assert layer_rows == [], "the layers section was not asked for"

    (tmp_path / "dequant.csv").unlink()
    run_python(["benchmarks/bench_layers.py", "--replot", "--out", str(tmp_path)], tmp_path)


GEN_REPEATS = 4  # not the default (5), so that the test sees the flag reach the rows; even: median of two middles


def test_bench_train_step_tiny_cpu(tmp_path):
    args = ["benchmarks/bench_train_step.py", "--device", "cpu", "--tiny", "--out", str(tmp_path),
            "--profile", "fastlora-nf4", "--gen-repeats", str(GEN_REPEATS), "--in-process"]  # fmt: skip
    log = run_python(args, tmp_path)
    assert "bench_train_step done" in log, log[-3000:]

    header, columns, rows = read(tmp_path / "train_step.csv")
    check_header(header)
    for col in ("provider", "batch", "seq", "ckpt", "tokens_per_s", "ratio_to_bf16", "peak_GiB", "status"):
        assert col in columns
    providers = {"bf16-lora", "peft-bnb-nf4", "peft-bnb-nf4-dq", "peft-bnb-int8", "fastlora-nf4", "fastlora-nf4-dq",
                 "fastlora-int8", "fastpath-nf4", "fastpath-graph-nf4"}  # fmt: skip
    assert {r["provider"] for r in rows} == providers
    assert {(r["batch"], r["ckpt"]) for r in rows} == {("1", "off"), ("1", "on"), ("2", "off"), ("2", "on")}
    bad = [(r["provider"], r["batch"], r["ckpt"], r["error"]) for r in rows if r["status"] != "ok"]
    assert not bad, f"rows that did not run: {bad}"
    assert all(float(r["tokens_per_s"]) > 0 for r in rows)
    # 2 decoder layers x 7 linear layers (the FastLoraModel tuner itself is not counted)
    assert all(int(r["fastlora_layers"]) == 14 for r in rows if r["provider"].startswith("fast"))
    assert "ref_tokens_per_s" not in rows[0], "no earlier run's numbers in the CSV"

    _, gen_columns, gen_rows = read(tmp_path / "generation.csv")
    assert {"provider", "new_tokens", "tokens_per_s", "ratio_to_bf16", "repeats", "tokens_per_s_min",
            "tokens_per_s_max", "ratio_to_bf16_round_median", "ratio_to_bf16_round_min", "ratio_to_bf16_round_max",
            "round_tokens_per_s"} <= set(gen_columns)  # fmt: skip
    assert [r["provider"] for r in gen_rows] == ["bf16-lora", "peft-bnb-nf4", "fastlora-nf4", "peft-bnb-int8",
                                                 "fastlora-int8"]  # fmt: skip
    assert all(r["status"] == "ok" and r["new_tokens"] == "8" for r in gen_rows)
    for r in gen_rows:
        assert int(r["repeats"]) == GEN_REPEATS and len(r["round_tokens_per_s"].split(";")) == GEN_REPEATS, r
        low, median, high = (float(r[c]) for c in ("tokens_per_s_min", "tokens_per_s", "tokens_per_s_max"))
        assert 0 < low <= median <= high, r
        low, median, high = (float(r[f"ratio_to_bf16_round_{c}"]) for c in ("min", "median", "max"))
        assert 0 < low <= median <= high, r
    bf16 = gen_rows[0]
    assert float(bf16["ratio_to_bf16_round_min"]) == float(bf16["ratio_to_bf16_round_max"]) == 1.0
    # One interleaved phase after all training: every provider's rounds are logged, each round in a rotated order.
    rounds = [line for line in log.splitlines() if "generate round" in line]
    assert len(rounds) == GEN_REPEATS and rounds[1].split(": ", 1)[1].startswith("peft-bnb-nf4"), rounds

    _, _, targets = read(tmp_path / "train_targets.csv")
    assert targets and {t["result"] for t in targets} <= {"PASS", "MISS", "N/A"}
    gen_targets = [t for t in targets if t["target"].startswith("generation")]
    assert len(gen_targets) == 2 and all("same-round" in t["note"] for t in gen_targets), gen_targets
    by_provider = {r["provider"]: r for r in gen_rows}
    for t in gen_targets:  # the target reads the median of the same-round ratios, not the ratio of the medians
        provider = t["target"].split(": ")[1].split(" /")[0]
        assert float(t["value"]) == pytest.approx(float(by_provider[provider]["ratio_to_bf16_round_median"]))
    check_png(tmp_path / "train_step.png")
    assert (tmp_path / "setup.csv").exists()
    profile = next(tmp_path.glob("profile_fastlora-nf4_*.txt")).read_text()
    assert "aten::" in profile  # on the CPU: the operator table (no CUDA kernels)
    assert "operators by input shapes" in profile  # an eager step's operators told apart by their shapes

    # --replot derives the same-round ratios again from round_tokens_per_s alone.
    (tmp_path / "train_step.png").unlink()
    replot = run_python(["benchmarks/bench_train_step.py", "--replot", "--out", str(tmp_path)], tmp_path)
    check_png(tmp_path / "train_step.png")
    assert "ratio_to_bf16_round_median" in replot
    _, _, replotted = read(tmp_path / "train_targets.csv")
    values = [float(t["value"] or "nan") for t in targets]  # the CSV keeps 6 digits: ratios move in the last one
    assert [float(t["value"] or "nan") for t in replotted] == pytest.approx(values, rel=1e-4, nan_ok=True)


def _bench_train_step():
    return _bench_module("bench_train_step")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "llama-1b"])
def test_every_arch_builds_a_model_of_its_shape(arch):
    """``--arch`` names a shape; transformers builds it from the model_type (``llama-1b`` is a Llama)."""
    from transformers import AutoModelForCausalLM

    B = _bench_train_step()
    config = B.model_config(tiny=True, arch=arch)
    assert config.model_type == B.MODEL_TYPES.get(arch, arch) and config.dtype == torch.bfloat16
    full = B.model_shape(arch)
    assert config.tie_word_embeddings == full["tie_word_embeddings"]
    model = AutoModelForCausalLM.from_config(config)
    assert len(model.model.layers) == config.num_hidden_layers
    if arch == "llama-1b":
        assert full["num_hidden_layers"] == 16 and full["hidden_size"] == 2048
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_generation_round_order_rotates():
    """Round i starts at provider i mod P: over P rounds every provider takes every position once."""
    B = _bench_train_step()
    providers = ["a", "b", "c"]
    assert B.round_order(providers, 0) == ["a", "b", "c"]
    assert B.round_order(providers, 1) == ["b", "c", "a"]
    assert B.round_order(providers, 2) == ["c", "a", "b"]
    assert B.round_order(providers, 3) == ["a", "b", "c"]
    for position in range(3):
        assert sorted(B.round_order(providers, i)[position] for i in range(3)) == providers
    assert B.round_order(["a"], 5) == ["a"] and B.round_order([], 2) == []
    assert providers == ["a", "b", "c"], "round_order must not reorder its argument"


def test_generation_same_round_ratios():
    """Ratios pair the rounds one by one (host drift cancels), skipping rounds that either side lacks."""
    B = _bench_train_step()
    base = [100.0, 50.0, 200.0]  # the host drifts 4x between rounds ...
    assert B.same_round_ratios([110.0, 55.0, 220.0], base) == pytest.approx([1.1, 1.1, 1.1])  # ... the ratio does not
    assert B.same_round_ratios([110.0, 55.0], base) == pytest.approx([1.1, 1.1])  # an interrupted provider
    assert B.same_round_ratios([110.0, None, 220.0], base) == pytest.approx([1.1, 1.1])
    assert B.same_round_ratios([1.0], []) == [] and B.same_round_ratios([1.0], [0.0]) == []

    summary = B.gen_summary([(8, 0.1), (8, 0.4), (8, 0.2)])  # (new tokens, seconds) per round
    assert summary["repeats"] == 3 and summary["new_tokens"] == 8
    assert (summary["tokens_per_s_min"], summary["tokens_per_s"], summary["tokens_per_s_max"]) == (20.0, 40.0, 80.0)
    assert B.round_rates(summary) == [80.0, 20.0, 40.0]
    assert B.round_rates({"round_tokens_per_s": 40.0}) == [40.0]  # one round reads back from the CSV as a number
    assert B.round_rates(None) == [] and B.round_rates({"round_tokens_per_s": None}) == []

    # derive: ratio_to_bf16 from the medians, ratio_to_bf16_round_* round by round; the target takes the latter.
    def row(provider, *rates):
        return dict(provider=provider, status="ok", **B.gen_summary([(8, 8 / r) for r in rates]))

    bf16, fast = row("bf16-lora", 80.0, 40.0, 20.0), row("fastlora-nf4", 40.0, 44.0, 30.0)
    B.derive([], [bf16, fast])
    assert fast["ratio_to_bf16"] == pytest.approx(1.0)  # medians 40 / 40
    assert fast["ratio_to_bf16_round_min"] == pytest.approx(0.5)  # rounds: 40/80, 44/40, 30/20
    assert fast["ratio_to_bf16_round_median"] == pytest.approx(1.1)
    assert fast["ratio_to_bf16_round_max"] == pytest.approx(1.5)
    checks = {c.target: c for c in B.train_targets([], [bf16, fast])}
    check = checks["generation tokens/s: fastlora-nf4 / bf16-lora"]
    assert check.value == pytest.approx(1.1) and "same-round" in check.note and check.result == "PASS"


FAILING_PROVIDERS = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "benchmarks")
    import _common, bench_layers, bench_train_step

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    real_layer = _common.make_provider_layer
    _common.make_provider_layer = lambda p, *a, **k: broken() if p == "peft-bnb-int8" else real_layer(p, *a, **k)
    bench_layers.main(["--device", "cpu", "--tiny", "--out", sys.argv[1] + "/layers", "--modes", "infer",
                       "--m", "1", "--sections", "layers", "--providers", "bf16-lora,peft-bnb-int8,fastlora-int8"])

    real_wrap = bench_train_step.wrap
    bench_train_step.wrap = lambda m, p, a: broken() if p == "peft-bnb-nf4" else real_wrap(m, p, a)
    bench_train_step.main(["--device", "cpu", "--tiny", "--out", sys.argv[1] + "/train", "--batches", "1",
                           "--ckpt", "off", "--providers", "bf16-lora,peft-bnb-nf4,fastlora-nf4",
                           "--gen-providers", "bf16-lora,peft-bnb-nf4", "--gen-repeats", "2", "--in-process"])

    # A generate that fails mid-way (fastlora-nf4's second timed one): its row is an error, the other rounds go on.
    real_prepare = bench_train_step.prepare_generation

    def prepare(model, args, *rest):
        generate = real_prepare(model, args, *rest)  # the warm-up generate runs in there, unbroken
        calls = []

        def flaky():
            calls.append(1)
            return broken() if len(calls) == 2 else generate()

        return flaky if type(model.peft_config["default"]).__name__ == "FastLoraConfig" else generate

    bench_train_step.prepare_generation = prepare
    bench_train_step.main(["--device", "cpu", "--tiny", "--out", sys.argv[1] + "/gen", "--providers", "bf16-lora",
                           "--batches", "1", "--ckpt", "off", "--gen-providers", "bf16-lora,fastlora-nf4",
                           "--gen-repeats", "3"])

    # A spent budget: every training and generation row is skipped, and the run still writes its outputs.
    bench_train_step.main(["--device", "cpu", "--tiny", "--out", sys.argv[1] + "/budget", "--batches", "1",
                           "--ckpt", "off", "--providers", "bf16-lora", "--gen-providers", "bf16-lora,fastlora-nf4",
                           "--budget-s", "0"])
    """
)


def test_failing_provider_becomes_error_row(tmp_path):
    """One interpreter covers both scripts (CI has 2 cores): a provider that fails is recorded, the run goes on."""
    script = tmp_path / "inject.py"
    script.write_text(FAILING_PROVIDERS)
    run_python([str(script), str(tmp_path)], tmp_path)

    _, _, rows = read(tmp_path / "layers" / "layers.csv")
    status = {r["provider"]: (r["status"], r["error"]) for r in rows}
    assert status["peft-bnb-int8"][0] == "error" and "injected failure" in status["peft-bnb-int8"][1]
    assert status["bf16-lora"][0] == "ok" and status["fastlora-int8"][0] == "ok"

    _, _, rows = read(tmp_path / "train" / "train_step.csv")
    status = {r["provider"]: (r["status"], r["error"]) for r in rows}
    assert status["peft-bnb-nf4"][0] == "error" and "injected failure" in status["peft-bnb-nf4"][1]
    assert status["bf16-lora"][0] == "ok" and status["fastlora-nf4"][0] == "ok"
    _, _, gen_rows = read(tmp_path / "train" / "generation.csv")
    # The generation phase loads peft-bnb-nf4 again (its wrap fails again); bf16-lora still runs its rounds.
    assert [(r["provider"], r["status"], r["repeats"]) for r in gen_rows] == [("bf16-lora", "ok", "2"),
                                                                              ("peft-bnb-nf4", "error", "")]
    assert "injected failure" in gen_rows[1]["error"]
    check_png(tmp_path / "train" / "train_step.png")

    _, _, gen_rows = read(tmp_path / "gen" / "generation.csv")
    status = {r["provider"]: r for r in gen_rows}
    assert status["fastlora-nf4"]["status"] == "error" and "injected failure" in status["fastlora-nf4"]["error"]
    assert status["bf16-lora"]["status"] == "ok" and status["bf16-lora"]["repeats"] == "3"

    _, _, rows = read(tmp_path / "budget" / "train_step.csv")
    _, _, gen_rows = read(tmp_path / "budget" / "generation.csv")
    assert {(r["status"], r["error"]) for r in rows + gen_rows} == {("skipped", "time budget")}
    assert [r["provider"] for r in gen_rows] == ["bf16-lora", "fastlora-nf4"]


def test_bench_lowrank_tiny_cpu(tmp_path):
    """bench_lowrank.py on the interpreter: one row per case and implementation, the kernel agreeing with cuBLAS."""
    run_python(["benchmarks/bench_lowrank.py", "--device", "cpu", "--tiny", "--out", str(tmp_path)], tmp_path)
    header, columns, rows = read(tmp_path / "lowrank.csv")
    check_header(header)
    assert {"case", "impl", "time_ms", "GBps", "speedup_vs_cublas"} <= set(columns)
    # M x N x case x (copy, cuBLAS, Triton); M x (h made, fused); M x (cuBLAS after, in pass); M x group x
    # (separate, grouped) x (fwd, fwd+bwd)
    assert len(rows) == 2 * 2 * 2 * 3 + 2 * 2 + 2 * 2 + 2 * 2 * 2 * 2
    groups = {f"{g} projection group, {m}" for g in ("q/k/v", "gate/up") for m in ("fwd", "fwd+bwd")}
    assert {r["case"] for r in rows if "group" in r["case"]} == groups
    for row in rows:
        assert float(row["time_ms"]) > 0
        if row["impl"] == "triton":
            assert float(row["max_abs_diff"]) <= 0.07, row  # bf16 rounding of O(1) values, one ulp at most
        if row["impl"] == "fused":
            assert float(row["max_abs_diff"]) <= 1e-3, row  # fp32 sums of the same products
        if row["impl"] == "grouped":
            assert float(row["max_abs_diff"]) <= 0.07, row  # bf16 rounding of O(1) values
        if row["impl"] == "in pass":  # bf16 B grads of sums over the rows, rounded once each way
            assert 0 <= float(row["max_abs_diff"]) <= 0.5, row


def test_bench_step_rounds_tiny_cpu(tmp_path):
    """bench_step_rounds.py: a row per (batch, ckpt, provider), each provider timed in every round, bf16 LoRA's
    same-round ratios exactly 1 and the others' taken round by round from the per-round rates it writes."""
    log = run_python(["benchmarks/bench_step_rounds.py", "--device", "cpu", "--tiny", "--out", str(tmp_path),
                      "--providers", "bf16-lora,fastlora-nf4", "--rounds", "3"], tmp_path)  # fmt: skip
    assert "bench_step_rounds done" in log, log[-3000:]
    header, columns, rows = read(tmp_path / "step_rounds.csv")
    check_header(header)
    assert [(r["ckpt"], r["provider"]) for r in rows] == [(c, p) for c in ("off", "on")
                                                          for p in ("bf16-lora", "fastlora-nf4")]  # fmt: skip
    for row in rows:
        rates = [float(v) for v in row["round_tokens_per_s"].split(";")]
        assert len(rates) == int(row["rounds"]) == 3 and all(r > 0 for r in rates)
        assert float(row["median_step_ms"]) > 0
    for ckpt in ("off", "on"):
        base, fast = (next(r for r in rows if r["ckpt"] == ckpt and r["provider"] == p)
                      for p in ("bf16-lora", "fastlora-nf4"))  # fmt: skip
        assert float(base["ratio_to_bf16_round_median"]) == 1.0
        ratios = sorted(float(f) / float(b) for f, b in zip(fast["round_tokens_per_s"].split(";"),
                                                             base["round_tokens_per_s"].split(";")))  # fmt: skip
        assert float(fast["ratio_to_bf16_round_median"]) == pytest.approx(ratios[1], rel=1e-4)
        assert float(fast["ratio_to_bf16_round_min"]) == pytest.approx(ratios[0], rel=1e-4)


def test_gpu_only_scripts_explain_themselves_on_cpu(tmp_path):
    """host_overhead.py measures CUDA launch overhead: on CPU it prints why it cannot run and exits 2; --help works."""
    assert "Host (CPU) time per layer call" in run_python(["benchmarks/host_overhead.py", "--help"], tmp_path)
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: host_overhead.py would run for real (run it as a benchmark)")
    proc = subprocess.run([sys.executable, "benchmarks/host_overhead.py", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=_env())  # fmt: skip
    assert proc.returncode == 2 and "needs a GPU" in proc.stdout, proc.stdout + proc.stderr
    assert "stripped-down GEMV kernels" in run_python(["benchmarks/probe_small_m.py", "--help"], tmp_path)
    proc = subprocess.run([sys.executable, "benchmarks/probe_small_m.py", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=_env())  # fmt: skip
    assert proc.returncode == 2 and "needs a GPU" in proc.stdout, proc.stdout + proc.stderr
    assert "record_trainer_steps" in run_python(["benchmarks/bench_trainer_step.py", "--help"], tmp_path)
    proc = subprocess.run([sys.executable, "benchmarks/bench_trainer_step.py", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=_env())  # fmt: skip
    assert proc.returncode == 2 and "needs a GPU" in proc.stdout, proc.stdout + proc.stderr


def test_run_gpu_sh_syntax_and_usage(tmp_path):
    """The driver parses, and rejects an unknown step before running anything."""
    assert subprocess.run(["bash", "-n", str(BENCH / "run_gpu.sh")]).returncode == 0
    proc = subprocess.run(["bash", str(BENCH / "run_gpu.sh"), str(tmp_path), "layers", "nonsense"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "unknown step 'nonsense'" in proc.stderr, proc.stdout + proc.stderr
    assert not (tmp_path / "layers.log").exists()


def test_readme_names_every_script():
    """benchmarks/README.md documents each script a user runs."""
    readme = (BENCH / "README.md").read_text()
    scripts = [p.name for p in BENCH.glob("*.py") if not p.name.startswith("_")] + ["run_gpu.sh"]
    missing = [name for name in scripts if name not in readme]
    assert not missing, f"benchmarks/README.md does not mention {missing}"


def test_common_row_helpers():
    C = _bench_module("_common")
    rows = [dict(provider="a", M=1, status="error"), dict(provider="a", M=1, status="ok", t=2.0),
            dict(provider="b", M=1, status="ok", t=4.0)]  # fmt: skip
    assert C.find_row(rows, provider="a", M=1) is rows[1], "error rows are never a baseline"
    assert C.find_row(rows, provider="c") is None
    assert C.ratio(4.0, 2.0) == 2.0 and C.ratio(None, 2.0) is None and C.ratio(1.0, 0) is None
    assert C.parse_shapes("4096x14336, 14336->4096") == [(4096, 14336), (14336, 4096)]
    assert C.parse_shapes(None) is None
    with pytest.raises(SystemExit, match="--shapes: expected IN x OUT items like '4096x14336', got '4096'"):
        C.parse_shapes("4096")
    assert C.cdiv(7, 2) == 4 and C.cdiv(8, 2) == 4 and C.copies_for(50 * 2**20, 50.0) == 3


def test_weight_bytes_counts_what_the_kernels_read():
    C = _bench_module("_common")
    weight = torch.randn(96, 64, dtype=torch.bfloat16)
    assert C.weight_bytes(weight) == 96 * 64 * 2
    packed, _, _ = C.quantize_nf4(weight, nested=False)
    assert C.weight_bytes(packed) == 96 * 64 // 2 + (96 * 64 // 64) * 4 + 16 * 4  # codes, fp32 absmax, NF4 table
    int8, _ = C.quantize_int8(weight)
    assert C.weight_bytes(int8) == 96 * 64 + 96 * 4  # int8 codes, fp32 row scales


def test_bench_train_step_runs_each_provider_in_its_own_process(tmp_path):
    """Without --in-process every provider runs in a child process (peak memory only compares that way); the parent
    merges the children's rows and derives the ratios across them."""
    args = ["benchmarks/bench_train_step.py", "--device", "cpu", "--tiny", "--out", str(tmp_path), "--batches", "1",
            "--ckpt", "off", "--providers", "bf16-lora,fastlora-nf4", "--gen-providers", "fastlora-nf4",
            "--gen-repeats", "1"]  # fmt: skip
    log = run_python(args, tmp_path)
    assert log.count("its own process ==") == 2, log[-3000:]
    _, _, rows = read(tmp_path / "train_step.csv")
    assert sorted(r["provider"] for r in rows) == ["bf16-lora", "fastlora-nf4"]
    assert all(r["status"] == "ok" for r in rows)
    fast = next(r for r in rows if r["provider"] == "fastlora-nf4")
    assert float(fast["ratio_to_bf16"]) > 0  # derived from the other child's row
    _, _, gen_rows = read(tmp_path / "generation.csv")
    assert [(r["provider"], r["status"]) for r in gen_rows] == [("fastlora-nf4", "ok")]
    for provider in ("bf16-lora", "fastlora-nf4"):
        assert (tmp_path / "providers" / provider / "train_step.csv").exists()


def test_a_lone_unsloth_provider_still_runs_in_its_own_process(tmp_path, monkeypatch):
    """Unsloth patches transformers on import: even as the only provider it goes through the isolated runner (which
    starts its own script), not the in-process loop that refuses it."""
    B = _bench_train_step()
    calls = []
    monkeypatch.setattr(B, "run_isolated", lambda args, argv, providers, *rest: calls.append(providers) or 0)
    assert B.main(["--device", "cpu", "--tiny", "--out", str(tmp_path), "--providers", "unsloth-nf4", "--no-gen"]) == 0
    assert calls == [["unsloth-nf4"]]
    with pytest.raises(SystemExit, match="its own process"):
        B.main(["--device", "cpu", "--tiny", "--out", str(tmp_path), "--providers", "unsloth-nf4", "--in-process"])


def test_child_argv_drops_the_options_the_parent_sets():
    B = _bench_train_step()
    argv = ["--tiny", "--providers", "a,b", "--out=x", "--model-dir", "m", "--keep-model", "--steps", "3", "--no-gen",
            "--profile", "a,b"]  # fmt: skip
    assert B.child_argv(argv) == ["--tiny", "--steps", "3"]  # each child gets --profile for its own provider only


def test_timeline_attributes_idle_gaps_to_the_host_operator_that_ended_them():
    """The profile timeline: GPU busy time, idle gaps by phase, the host operator that ended each gap, the largest
    gaps with their kernels, syncs."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    C = _bench_module("_common")

    def event(name, start, end, device):
        return NS(name=name, time_range=NS(start=start, end=end), device_type=device)

    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    events = [
        event("aten::mm", 0, 50, cpu), event("cudaLaunchKernel", 40, 45, cpu), event("kernel_a", 45, 60, gpu),
        event("autograd::engine::evaluate_function: MmBackward0", 60, 200, cpu), event("aten::mm", 100, 190, cpu),
        event("cudaLaunchKernel", 180, 185, cpu), event("kernel_b", 185, 300, gpu),
        event("cudaStreamSynchronize", 200, 300, cpu),
    ]  # fmt: skip
    lines = C.timeline_lines(events)
    assert lines[0].startswith("timeline: span 0.30 ms, GPU busy 0.13 ms (43 %)"), lines[0]
    assert lines[1] == "idle by phase (ms): backward 0.12, forward 0.04", lines[1]
    assert "autograd::engine::evaluate_function: MmBackward0 > aten::mm" in lines[3]  # the longest gap first
    assert any("cudaStreamSynchronize in (top level)" in line for line in lines)
    # the largest gaps, with the kernels either side (a replayed CUDA graph has no host operator to name)
    start = lines.index("largest 15 idle gaps (start ms into the span, idle ms, kernel before > kernel after):")
    largest = ["     0.060    0.125  kernel_a > kernel_b", "     0.000    0.045  - > kernel_a"]
    assert lines[start + 1 : start + 3] == largest
    assert C.timeline_lines([event("aten::mm", 0, 1, cpu)]) == ["(no GPU or host events recorded)"]


def _run_ptx(asm: str, word: int, operands: tuple[int, ...] = ()) -> list[int]:
    """Executes the straight-line PTX of ``probe_small_m``'s decodes (mov/and/or/shl/shr/prmt/lop3 on b32) for input
    ``$4 = word`` and ``operands`` as ``$5, $6, ...``; returns the 8 16-bit patterns of ``$0..$3`` (low half first)."""
    regs = {"$4": word, **{f"${5 + i}": v for i, v in enumerate(operands)}}

    def val(x: str) -> int:
        return regs[x] if x in regs else int(x, 0)

    for ins in (part.strip() for part in asm.strip("{} ").split(";")):
        if not ins or ins.startswith(".reg"):
            continue
        op, rest = ins.split(None, 1)
        a = [x.strip() for x in rest.split(",")]
        if op == "prmt.b32":  # default mode: result byte i = byte (c >> 4i) & 7 of {b, a}, or with bit 3 of that
            src, sel = val(a[1]) | (val(a[2]) << 32), val(a[3])  # selector nibble set, its top bit replicated
            picked = [(src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF for i in range(4)]
            picked = [0xFF * (b >> 7) if (sel >> (4 * i)) & 8 else b for i, b in enumerate(picked)]
            regs[a[0]] = sum(b << (8 * i) for i, b in enumerate(picked))
        elif op == "lop3.b32":  # bit j of d = bit (4 a_j + 2 b_j + c_j) of the LUT (PTX: a 0xF0, b 0xCC, c 0xAA)
            x, y, z, lut = (val(v) for v in a[1:])
            regs[a[0]] = sum(((lut >> (((x >> j) & 1) * 4 + ((y >> j) & 1) * 2 + ((z >> j) & 1))) & 1) << j
                             for j in range(32))  # fmt: skip
        else:
            fn = {"mov.b32": lambda x: x, "and.b32": lambda x, y: x & y, "or.b32": lambda x, y: x | y,
                  "shr.b32": lambda x, y: x >> y, "shl.b32": lambda x, y: x << y}[op]  # fmt: skip
            regs[a[0]] = fn(*(val(x) for x in a[1:])) & 0xFFFFFFFF
    return [half for r in ("$0", "$1", "$2", "$3") for half in (regs[r] & 0xFFFF, regs[r] >> 16)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decode", ["written-in table", "table operands", "bit select"])
def test_probe_prmt_decode_gives_the_codes_of_a_word(dtype, decode):
    """The byte-permute decode of the ``tcprmt`` / ``cuprmt`` / ``cuh2*`` probes is right (what makes ``tcprmt`` wrong
    on the GPU is the layout Triton gives its input): element 8w + j of a word is the code of nibble j, high nibble
    first, as bf16 or fp16; with the table as operands (``cuh2r``, ``cuh2hr``) and with the table half chosen by a
    bit select (``cuh2s``) as with it written in."""
    probe = _bench_module("probe_small_m")
    code = torch.linspace(-1, 1, 16) ** 3  # 16 distinct values with distinct low and high bytes in both dtypes
    if decode == "bit select":
        asm = probe.prmt_select_decode_asm()
    else:
        asm = probe.prmt_decode_asm(code, dtype, decode == "table operands")
    operands = tuple(probe.prmt_table_words(code, dtype)) + (0x4444,) if decode != "written-in table" else ()
    assert ("mov.b32" in asm) == (decode == "written-in table")  # the table comes in one way only
    bits = (code.to(dtype).view(torch.int16).to(torch.int32) & 0xFFFF).tolist()
    gen = torch.Generator().manual_seed(0)
    for word in torch.randint(0, 2**32, (300,), generator=gen, dtype=torch.int64).tolist():
        nibbles = [(word >> (8 * (j // 2) + 4 * (1 - j % 2))) & 0xF for j in range(8)]
        assert _run_ptx(asm, word, operands) == [bits[q] for q in nibbles], hex(word)


def _sm90_script_counts(script: str) -> dict:
    """Runs a script that compiles probes for sm_90 (in a subprocess without ``TRITON_INTERPRET``, since the
    interpreter's kernels cannot be compiled) and returns the JSON counts its last line prints."""
    pytest.importorskip("triton.backends.nvidia")
    env = {key: value for key, value in _env().items() if key != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


CUPRMT_PTX = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, "benchmarks")
    import torch
    import probe_small_m as P
    from tests.ops._sm90_ptx import sm90_ptx

    pointers = dict(x_ptr="*bf16", w_ptr="*i32", absmax_ptr="*u8", nested_code_ptr="*fp32", nested_absmax_ptr="*fp32",
                    offset_ptr="*fp32", code_ptr="*fp32", out_ptr="*fp32")
    scalars = ("N", "words_per_row", "blocks_per_row", "words_per_split", "n_words")
    counts = {}
    for variant in ("cuprmt", "cuprmt2"):
        constexprs = dict(MODE=P.MODES[variant], NESTED_BLOCKSIZE=256, ATOMIC=True, MUL_RN=True, BLOCK_N=8,
                          BLOCK_K=512, DECODE_ASM=P.prmt_decode_asm(torch.linspace(-1, 1, 16) ** 3))
        signature = {**pointers, **dict.fromkeys(scalars, "i32"), **dict.fromkeys(constexprs, "constexpr")}
        ptx = sm90_ptx(P._probe_4bit_cuprmt, signature, constexprs, num_warps=1, num_stages=1)
        counts[variant] = dict(prmt=ptx.count("prmt.b32"), odd_masks=ptx.count("-65536"),
                               code_shuffles=ptx.count("0x101f"), laneid=ptx.count("%laneid"))
    print(json.dumps(counts))
    """
)


def test_probe_cuprmt_decodes_by_permutes_without_shuffles():
    """The ``cuprmt`` probe compiled for sm_90 ahead of time (no GPU; a subprocess, since the interpreter's kernels
    cannot be compiled), 8 x 512 on one warp: each thread decodes its 16 words a step with 16 byte permutes each and
    no code-table shuffle or lane id (the sums' reductions keep their own shuffles); ``cuprmt`` masks the 64 odd
    elements, ``cuprmt2`` does not."""
    counts = _sm90_script_counts(CUPRMT_PTX)
    assert counts["cuprmt"] == {"prmt": 256, "odd_masks": 64, "code_shuffles": 0, "laneid": 0}
    assert counts["cuprmt2"] == {"prmt": 256, "odd_masks": 0, "code_shuffles": 0, "laneid": 0}


PACKED_PTX = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, "benchmarks")
    import torch
    import probe_small_m as P
    from tests.ops._sm90_ptx import sm90_ptx

    types = dict(x_ptr="*i32", w_ptr="*i32", absmax_ptr="*u8", nested_code_ptr="*fp32", nested_absmax_ptr="*fp32",
                 offset_ptr="*fp32", code_ptr="*fp32", out_ptr="*fp32", table_ptr="*i32",
                 **dict.fromkeys(("N", "words_per_row", "blocks_per_row", "words_per_split", "n_words"), "i32"))
    counts = {}
    for variant in ("cuh2", "cuh2r", "cuh2hr", "cuh2s"):
        half = torch.float16 if variant in P.FP16_MODES else torch.bfloat16
        operands = variant in P.TABLE_OPERAND_MODES
        code = torch.linspace(-1, 1, 16) ** 3
        decode = P.prmt_select_decode_asm() if variant == "cuh2s" else P.prmt_decode_asm(code, half, operands)
        constexprs = dict(MODE=P.MODES[variant], NESTED_BLOCKSIZE=256, ATOMIC=True, MUL_RN=True, BLOCK_N=8,
                          BLOCK_K=512, DECODE_ASM=decode,
                          DOT_ASM=P.PACKED_DOT_ASM["fp16" if half == torch.float16 else "bf16"],
                          TABLE_OPERANDS=operands, **({} if operands else dict(table_ptr=None)))
        signature = {name: "constexpr" if name in constexprs else types[name]
                     for name in P._probe_4bit_packed.arg_names}
        ptx = sm90_ptx(P._probe_4bit_packed, signature, constexprs, num_warps=1, num_stages=1)
        counts[variant] = dict(prmt=ptx.count("prmt.b32"), fma_bf16x2=ptx.count("fma.rn.bf16x2"),
                               fma_f16x2=ptx.count("fma.rn.f16x2"), table_movs=ptx.count("mov.b32 t0,"),
                               code_shuffles=ptx.count("0x101f"))
    print(json.dumps(counts))
    """
)


def test_probe_packed_variants_sum_each_word_in_packed_fmas():
    """The ``cuh2*`` probes compiled for sm_90 ahead of time, 8 x 512 on one warp: each thread decodes its 16 words
    a step by byte permutes and sums each word's 8 products in 4 packed FMAs (bf16x2, or f16x2 for ``cuh2hr``), with
    no code-table shuffle; ``cuh2r``, ``cuh2hr`` and ``cuh2s`` take the table as operands instead of writing it into
    each word's decode, and ``cuh2s`` needs 14 permutes a word instead of 16 (its table half chosen by ``lop3``)."""
    counts = _sm90_script_counts(PACKED_PTX)
    common = dict(prmt=256, code_shuffles=0)
    assert counts["cuh2"] == dict(common, fma_bf16x2=64, fma_f16x2=0, table_movs=16), counts
    assert counts["cuh2r"] == dict(common, fma_bf16x2=64, fma_f16x2=0, table_movs=0), counts
    assert counts["cuh2hr"] == dict(common, fma_bf16x2=0, fma_f16x2=64, table_movs=0), counts
    assert counts["cuh2s"] == dict(common, prmt=16 * 14, fma_bf16x2=64, fma_f16x2=0, table_movs=0), counts
