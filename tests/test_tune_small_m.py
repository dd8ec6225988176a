"""CPU checks of benchmarks/tune_small_m.py without a GPU or a kernel run: arguments, the candidate grid, the crossover
rule, the JSON table (format, merge) and the outputs written from result rows."""

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import tune_small_m as T  # noqa: E402

from peft_fastlora.ops.kernels import tuning  # noqa: E402

SMS = 132
FIELDS = {"use_dot", "block_n", "block_k", "split_k", "num_warps", "num_stages"}


def is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


# ---- arguments -----------------------------------------------------------------------------------------------------


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        T.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--out", "--shapes", "--kinds", "--ms", "--time-budget", "--merge", "--compile-workers"):
        assert option in out


def test_defaults():
    args = T.build_parser().parse_args([])
    assert args.shapes == [(4096, 4096), (14336, 4096), (4096, 14336)]
    assert args.kinds == ["nf4", "int8"] and args.ms == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert args.time_budget == 240 and args.merge is None


def test_parsing():
    args = T.build_parser().parse_args(["--shapes", "14336x4096, 64X128", "--kinds", "int8", "--ms", "16,1,16"])
    assert args.shapes == [(14336, 4096), (64, 128)] and args.kinds == ["int8"] and args.ms == [1, 16]


@pytest.mark.parametrize("argv,needle", [
    (["--shapes", "4096"], "NxK"), (["--shapes", "4096x0"], "NxK"), (["--kinds", "fp8"], "nf4"),
    (["--ms", "1,a"], "positive integers"), (["--ms", "0"], "positive integers"),
])  # fmt: skip
def test_bad_arguments_name_the_problem(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_info:
        T.main(argv)
    assert exit_info.value.code == 2
    assert needle in capsys.readouterr().err


LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 64, "model_type": "llama"}  # fmt: skip


def test_model_config_gives_the_linear_shapes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_1B))
    for value in (tmp_path, tmp_path / "config.json"):  # the folder or the file
        args = T.build_parser().parse_args(["--model-config", str(value)])
        assert args.model_shapes == [(2048, 2048), (512, 2048), (8192, 2048), (2048, 8192)]  # q = o, k/v, up, down
    # no head_dim / num_key_value_heads: hidden / heads, and as many K/V heads as heads; nested text_config
    nested = {"text_config": {k: v for k, v in LLAMA_1B.items() if k not in ("head_dim", "num_key_value_heads")}}
    assert T.shapes_of_model(nested) == [(2048, 2048), (8192, 2048), (2048, 8192)]


def test_model_config_errors_name_the_file_and_the_key(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(SystemExit) as exit_info:
        T.main(["--model-config", str(bad), "--plan"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "intermediate_size" in err
    with pytest.raises(SystemExit):
        T.main(["--model-config", str(tmp_path / "absent"), "--plan"])
    assert "cannot read the linear shapes" in capsys.readouterr().err
    bad.write_text(json.dumps(LLAMA_1B))
    with pytest.raises(SystemExit):  # one or the other
        T.main(["--model-config", str(bad), "--shapes", "64x64"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_model_config_shapes_are_what_the_run_uses(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_1B))
    assert T.main(["--model-config", str(tmp_path), "--plan", "--kinds", "nf4"]) == 0
    out = capsys.readouterr().out
    assert all(f"nf4  {shape:11s} M=16" in out for shape in ("2048x2048", "512x2048", "8192x2048", "2048x8192"))
    assert "4096x4096" not in out


def test_without_cuda_exits_with_a_clear_message(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        T.main(["--out", str(tmp_path)])
    assert "torch.cuda.is_available() is False" in str(exit_info.value.code)
    assert not list(tmp_path.iterdir())


def test_plan_needs_no_gpu(capsys):
    assert T.main(["--plan"]) == 0
    out = capsys.readouterr().out
    assert "nf4  14336x4096  M=16" in out and "compiles" in out


# ---- the grid ------------------------------------------------------------------------------------------------------


def test_effective_split_is_what_launch_runs():
    assert T.effective_split_k(14336, 1024, 8) == 7  # 14 K-tiles: 2 per split -> 7 splits
    assert T.effective_split_k(4096, 512, 16) == 8  # no more splits than K-tiles
    assert T.effective_split_k(4096, 128, 1) == 1
    for k, bk, s in [(4096, 128, 7), (14336, 256, 6), (4096, 64, 16), (14336, 1024, 3)]:
        e = T.effective_split_k(k, bk, s)
        assert 1 <= e <= s and T.effective_split_k(k, bk, e) == e  # stable: what we store is what runs
        k_per_split = T.cdiv(T.cdiv(k, bk), e) * bk
        assert (e - 1) * k_per_split < k <= e * k_per_split  # no empty split


@pytest.mark.parametrize("n,k", T.SHAPES)
@pytest.mark.parametrize("m", [1, 16])
def test_grid_is_pruned_and_valid(n, k, m):
    grid = T.candidate_grid(m, n, k, SMS, unfactored=True)
    assert len(grid) == len(set(grid)) and 20 <= len(grid) <= 80
    for t in grid:
        assert is_pow2(t.block_n) and is_pow2(t.block_k) and is_pow2(t.num_warps) and 16 <= t.block_k <= k
        per_thread = t.block_n * t.block_k // (32 * t.num_warps)
        low, high = T.elems_per_thread(t.use_dot)
        assert low <= per_thread <= high, t
        assert t.split_k == T.effective_split_k(k, t.block_k, t.split_k), t
        assert t.num_stages == 1
        if t.use_dot:
            assert t.block_n >= 16 and t.num_warps <= t.block_n // 4, t
    if m == 1:
        assert any(t.use_dot for t in grid) and any(not t.use_dot for t in grid)
        assert any(t.factor_scales is False for t in grid)
        packed = [t for t in grid if t.packed_dot]  # the packed bf16 path: one-warp FMA tiles with factored scales
        assert packed and all(not t.use_dot and t.factor_scales and t.num_warps == 1 for t in packed)
    else:
        assert all(t.use_dot and t.factor_scales is True and not t.packed_dot for t in grid)


@pytest.mark.parametrize("m", [1, 16])
def test_m1_stages_add_staged_copies_of_the_factored_fma_tilings_only(m):
    n, k = 4096, 14336
    plain = T.candidate_grid(m, n, k, SMS, unfactored=True)
    staged = T.candidate_grid(m, n, k, SMS, unfactored=True, m1_stages=(1, 3))
    extra = [t for t in staged if t not in plain]
    if m == 1:
        expected = [dataclasses.replace(t, num_stages=3) for t in plain if not t.use_dot and t.factor_scales]
        assert sorted(map(str, extra)) == sorted(map(str, expected)) and extra
    else:
        assert staged == plain and not extra


def test_compiled_variants_stay_few():
    """Triton compiles one binary per tiling (split_k included): the pass-1 grid over the default shapes is bounded."""
    distinct = {t for n, k in T.SHAPES for m in (1, 16) for t in T.candidate_grid(m, n, k, SMS, unfactored=True)}
    assert len(distinct) <= 190  # ~1 s of compile each, on the workers, within the 240 s budget


def test_splits_aim_at_the_target_program_count():
    n, k, bn, bk, nw = 4096, 4096, 32, 128, 4
    splits = T.split_candidates(16, n, k, True, bn, bk, nw, SMS, keep=2)
    target = SMS * T.WARPS_PER_SM_TARGET / nw
    assert splits == [4, 8]
    assert all(abs(math.log2(n // bn * s / target)) <= T.SPLIT_WINDOW for s in splits)
    # A program count far off at every split still gets the nearest one.
    assert T.split_candidates(1, 10**6, 256, False, 8, 256, 4, SMS, keep=3) == [1]


def test_finalists_rescale_split_k_for_more_row_tiles():
    k = 4096
    ranked = [T.make_tiling(k, True, 32, 128, 8, 4), T.make_tiling(k, True, 64, 128, 4, 4),
              T.make_tiling(k, False, 8, 512, 2, 4), T.make_tiling(k, True, 16, 256, 8, 2),
              T.make_tiling(k, True, 32, 256, 2, 4), T.make_tiling(k, True, 128, 64, 1, 8)]  # fmt: skip
    dot = [t for t in ranked if t.use_dot]
    assert T.finalists(ranked, 8, 16, k, top=4) == dot[:4]  # one row tile, as at M=16
    at_64 = T.finalists(ranked, 64, 16, k, top=4)
    assert at_64[:4] == dot[:4] and all(t.use_dot for t in at_64)
    assert T.make_tiling(k, True, 32, 128, 2, 4) in at_64 and T.make_tiling(k, True, 64, 128, 1, 4) in at_64
    # past 16 rows also programs of the fewest rows that hold them (32 or 64): one decode of W for every row
    assert at_64[6:] == [dataclasses.replace(t, block_m=64) for t in dot[:4]]
    assert len(at_64) == len(set(at_64)) == 10
    at_24 = T.finalists(ranked, 24, 16, k, top=2)
    assert [t.block_m for t in at_24] == [16, 16, 16, 16, 32, 32] and T.tiling_label(at_24[-1]).endswith(" m32")
    assert all(t.block_m == 16 for t in T.finalists(ranked, 16, 16, k))


# ---- crossover -----------------------------------------------------------------------------------------------------

MS = [1, 2, 4, 8, 16, 24, 32]


@pytest.mark.parametrize("fused,large,expected", [
    ({m: 1.0 for m in MS}, {m: 2.0 for m in MS}, 32),  # wins everywhere: the end of the grid
    ({1: 1, 2: 1, 4: 1, 8: 1, 16: 1, 24: 3, 32: 1}, {m: 2.0 for m in MS}, 16),  # a later win does not count
    ({m: 3.0 for m in MS}, {m: 2.0 for m in MS}, 0),  # never faster
    ({1: 1, 2: 1, 4: 1, 16: 1}, {m: 2.0 for m in MS}, 4),  # M=8 not measured: the scan ends there
    ({1: 1, 2: 2.0}, {1: 2, 2: 2.0}, 1),  # a tie is not a win
    ({1: 1, 2: float("nan")}, {1: 2, 2: 2}, 1),
    ({1: 1, 2: 1}, {1: 2, 2: None}, 1),
])  # fmt: skip
def test_crossover_rule(fused, large, expected):
    assert T.crossover_m(MS, fused, large) == expected


# ---- JSON table ----------------------------------------------------------------------------------------------------


def test_the_tuner_uses_the_package_table_format():
    """One owner of the format and of the tiling record: the tuner imports them, it does not re-declare them."""
    assert T.Tiling is tuning.SmallMConfig
    for name in ("merge_tables", "read_table", "effective_split_k", "shape_key"):
        assert getattr(T, name) is getattr(tuning, name), name
    table = T.results_table(fake_rows(), MS, "NVIDIA H200", "2.11.0", "3.6.0", "2025-01-31")
    assert tuning.check_table(table, "results") is table


def fake_rows() -> list[dict]:
    rows = []
    fma = T.make_tiling(4096, False, 8, 1024, 1, 4)
    dot = T.make_tiling(4096, True, 32, 128, 7, 4)
    unfactored = T.make_tiling(4096, False, 16, 512, 2, 4, factor_scales=False)
    # nf4: M=4 and 8 not measured, so its crossover is 2; int8: wins up to 16, loses at 24, so 16.
    timings = [(1, 5.0, 20.0), (2, 6.0, 20.0), (4, 6.0, 20.0), (8, 7.0, 20.0), (16, 9.0, 21.0), (24, 30.0, 22.0)]
    for kind, shape, n, k in [("nf4", "4096x4096", 4096, 4096), ("int8", "14336x4096", 14336, 4096)]:
        for m, fwd, large in [t for t in timings if kind == "int8" or t[0] not in (4, 8)]:
            tiling = (unfactored if kind == "nf4" else fma) if m == 1 else dot
            rows.append(dict(kind=kind, shape=shape, N=n, K=k, M=m, tiling=tiling, best=T.tiling_label(tiling),
                             best_us=fwd - 1, fwd_us=fwd, default_us=fwd, default_fwd_us=fwd + 1, large_us=large,
                             bnb_us=12.0, weight_MB=9.4, GBps=2000.0, pct_copy=50.0, candidates=40, wrong=1, errors=0,
                             status="ok"))  # fmt: skip
    rows.append(dict(kind="int8", shape="14336x4096", N=14336, K=4096, M=32, candidates=3, wrong=3, errors=0,
                     status="no verified tiling"))  # fmt: skip
    return rows


def test_table_has_the_loader_format():
    table = T.results_table(fake_rows(), MS, "NVIDIA H200", "2.11.0", "3.6.0", "2025-01-31")
    assert table["format"] == 1 and list(table["devices"]) == ["NVIDIA H200"]
    device = table["devices"]["NVIDIA H200"]
    assert {k: device[k] for k in ("torch", "triton", "date")} == {"torch": "2.11.0", "triton": "3.6.0",
                                                                   "date": "2025-01-31"}  # fmt: skip
    assert set(device["kinds"]) == {"nf4", "int8"}
    entry = device["kinds"]["int8"]["14336x4096"]
    assert set(entry) == {"crossover_m", "configs"} and entry["crossover_m"] == 16
    assert list(entry["configs"]) == ["1", "2", "4", "8", "16", "24"]  # M as strings, ascending; not M=32 (no tiling)
    for config in entry["configs"].values():
        assert set(config) == FIELDS and isinstance(config["use_dot"], bool)
        assert all(isinstance(config[f], int) and not isinstance(config[f], bool) for f in FIELDS - {"use_dot"})
    assert entry["configs"]["1"] == {"use_dot": False, "block_n": 8, "block_k": 1024, "split_k": 1, "num_warps": 4,
                                     "num_stages": 1}  # fmt: skip
    # factor_scales is written only where a tiling sets it.
    assert device["kinds"]["nf4"]["4096x4096"]["configs"]["1"]["factor_scales"] is False
    assert json.loads(tuning.dumps_table(table)) == table


def test_json_is_one_line_per_tiling(tmp_path):
    table = T.results_table(fake_rows(), MS, "NVIDIA H200", "2.11.0", "3.6.0", "2025-01-31")
    T.write_table(tmp_path / "t.json", table)
    text = (tmp_path / "t.json").read_text()
    assert json.loads(text) == table
    line = '"2": {"use_dot": true, "block_n": 32, "block_k": 128, "split_k": 7, "num_warps": 4, "num_stages": 1}'
    assert line in text


def test_merge_keeps_other_devices_and_shapes(tmp_path):
    old = {"format": 1, "devices": {
        "NVIDIA H100 80GB HBM3": {"torch": "2.9", "triton": "3.5", "date": "2024-12-01", "kinds": {"nf4": {}}},
        "NVIDIA H200": {"torch": "2.9", "triton": "3.5", "date": "2024-12-01", "kinds": {
            "nf4": {"4096x4096": {"crossover_m": 8, "configs": {}}, "1024x1024": {"crossover_m": 4, "configs": {}}},
            "int8": {"4096x14336": {"crossover_m": 2, "configs": {}}}}}}}  # fmt: skip
    new = T.results_table(fake_rows(), MS, "NVIDIA H200", "2.11.0", "3.6.0", "2025-01-31")
    merged = T.merge_tables(old, new)
    assert merged["devices"]["NVIDIA H100 80GB HBM3"] == old["devices"]["NVIDIA H100 80GB HBM3"]
    h200 = merged["devices"]["NVIDIA H200"]
    assert (h200["torch"], h200["triton"], h200["date"]) == ("2.11.0", "3.6.0", "2025-01-31")
    assert h200["kinds"]["nf4"]["4096x4096"]["crossover_m"] == 2  # measured again: replaced
    assert h200["kinds"]["nf4"]["1024x1024"]["crossover_m"] == 4  # not measured: kept
    assert set(h200["kinds"]["int8"]) == {"4096x14336", "14336x4096"}
    assert old["devices"]["NVIDIA H200"]["kinds"]["nf4"]["4096x4096"]["crossover_m"] == 8  # inputs not modified

    target = tmp_path / "configs.json"
    T.write_table(target, old)
    source = tmp_path / "new.json"
    T.write_table(source, new)
    assert T.main(["--from-json", str(source), "--merge", str(target)]) == 0
    assert json.loads(target.read_text()) == merged


def test_merge_rejects_what_is_not_a_table(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"devices": {}}')
    with pytest.raises(ValueError, match="not a small-M tuning table"):
        T.read_table(bad)
    with pytest.raises(SystemExit, match="not a small-M tuning table"):
        T.main(["--from-json", str(bad), "--merge", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="needs --merge"):
        T.main(["--from-json", str(bad)])


# ---- outputs from result rows --------------------------------------------------------------------------------------


def test_finalize_writes_csv_json_and_plot(tmp_path, capsys):
    rows = fake_rows()
    env = {"gpu": "NVIDIA H200 (fake)", "torch": "2.11.0", "date": "2025-01-31"}
    merge = tmp_path / "shipped.json"
    T.write_table(merge, {"format": 1, "devices": {"NVIDIA H100": {"kinds": {}}}})
    cand = [dict(kind="nf4", shape="4096x4096", M=1, source="grid", config="fma n8 k1024 s1 w4", us=5.0, status="ok")]
    T.finalize(rows, cand, MS, tmp_path, env, 4000.0, "NVIDIA H200", ("2.11.0", "3.6.0"), merge)
    out = capsys.readouterr().out
    assert "crossover_m = 2" in out and "crossover_m = 16" in out and "failed" not in out

    lines = (tmp_path / "tune_small_m.csv").read_text().splitlines()
    assert lines[0].startswith("# gpu: NVIDIA H200")
    columns = next(line for line in lines if not line.startswith("#")).split(",")
    assert columns == T.SUMMARY_COLUMNS
    assert (tmp_path / "tune_candidates.csv").exists()
    table = json.loads((tmp_path / T.JSON_NAME).read_text())
    assert set(table["devices"]) == {"NVIDIA H100", "NVIDIA H200"} == set(json.loads(merge.read_text())["devices"])
    assert table["devices"]["NVIDIA H200"]["kinds"]["nf4"]["4096x4096"]["crossover_m"] == 2
    assert (tmp_path / "tune_small_m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_check_defaults_writes_no_table_and_prints_the_heuristic_crossover(tmp_path, capsys):
    rows = fake_rows()
    env = {"gpu": "NVIDIA H200 (fake)", "torch": "2.11.0", "date": "2025-01-31"}
    T.finalize(rows, [], MS, tmp_path, env, 4000.0, "NVIDIA H200", ("2.11.0", "3.6.0"), None, check=True)
    out = capsys.readouterr().out
    # default_fwd_us is fwd_us + 1: nf4 still wins at 1 and 2 (4 unmeasured), int8 up to 16 (31 > 22 at 24)
    assert "nf4   4096x4096   heuristic crossover_m = 2" in out
    assert "int8  14336x4096  heuristic crossover_m = 16" in out and "M=24:0.71x" in out
    assert (tmp_path / "tune_small_m.csv").exists() and not (tmp_path / T.JSON_NAME).exists()


def test_check_defaults_refuses_merge(tmp_path):
    with pytest.raises(SystemExit, match="writes no table: drop --merge"):
        T.main(["--check-defaults", "--merge", str(tmp_path / "t.json")])


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_check_defaults_times_the_heuristic_and_the_table(monkeypatch, kind):
    """The heuristic's tiling for this kind (int8 and nf4 differ at M = 1) first, then the table's where tabled."""
    from peft_fastlora.ops.kernels import small_m

    monkeypatch.setattr(small_m, "_sm_count", lambda index: SMS)
    tabled = tuning.SmallMConfig(True, 64, 128, 8, 4, block_m=32)
    monkeypatch.setattr(tuning, "tuned_config", lambda device, kind, m, n, k: tabled if m > 16 else None)
    args = T.build_parser().parse_args(["--check-defaults", "--kinds", kind])
    tuner = T.Tuner(args, torch.device("cuda", 0))
    case = T.Case(kind, 64, 4096, torch.device("cpu"), l2_mb=0.001)
    (default, source), = tuner.pass1_candidates(case, 1)
    assert source == "default" and default == T.make_tiling(4096, **dataclasses.asdict(
        small_m.heuristic_config(1, 64, 4096, torch.device("cuda", 0), kind)))  # fmt: skip
    assert default.num_warps == (1 if kind == "nf4" else 4)
    candidates = tuner.pass2_candidates(case, 24)
    assert [source for _, source in candidates] == ["default", "table"] and candidates[1][0] == tabled


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_case_builds_its_layers_and_containers_on_cpu(kind):
    """The sweep's weights and PEFT layers (bitsandbytes quantizes on the CPU too): a renamed helper fails here, not
    minutes into a GPU run."""
    case = T.Case(kind, 64, 128, torch.device("cpu"), l2_mb=0.001)
    assert case.copies == 2 and len(case.layers) == len(case.weights) == len(case.lora_a) == 2
    assert all(w.shape == (64, 128) for w in case.weights)
    assert case.weight_bytes > 64 * 128 // 2
