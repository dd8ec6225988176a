"""``ops/kernels/tuning.py``: the small-M tuning table's format (read, validate, merge, write) and its lookups."""

import json

import pytest
import torch

from peft_fastlora.ops.kernels import tuning
from peft_fastlora.ops.kernels.tuning import SmallMConfig

CFG1 = {"use_dot": False, "block_n": 8, "block_k": 1024, "split_k": 1, "num_warps": 4, "num_stages": 1}
CFG16 = {"use_dot": True, "block_n": 64, "block_k": 128, "split_k": 7, "num_warps": 4, "num_stages": 1}
DEVICE = {"kinds": {"nf4": {"4096x4096": {"crossover_m": 24, "configs": {"1": CFG1, "16": CFG16}}}}}


def table(**devices) -> dict:
    return {"format": 1, "devices": json.loads(json.dumps(devices))}


def test_lookup_takes_smallest_tabled_m_at_or_above():
    assert tuning.lookup_config(DEVICE, "nf4", 1, 4096, 4096) == SmallMConfig(**CFG1)
    assert tuning.lookup_config(DEVICE, "nf4", 9, 4096, 4096) == SmallMConfig(**CFG16)
    assert tuning.lookup_config(DEVICE, "nf4", 40, 4096, 4096) == SmallMConfig(**CFG16)  # beyond: the largest M
    assert tuning.lookup_crossover(DEVICE, "nf4", 4096, 4096) == 24


def test_lookup_misses_return_none():
    assert tuning.lookup_config(DEVICE, "int8", 1, 4096, 4096) is None
    assert tuning.lookup_config(DEVICE, "nf4", 1, 4096, 14336) is None
    assert tuning.lookup_crossover(DEVICE, "nf4", 14336, 4096) is None
    assert tuning.lookup_config({}, "nf4", 1, 4096, 4096) is None
    only_fma = {"kinds": {"nf4": {"64x64": {"configs": {"1": CFG1}}}}}
    assert tuning.lookup_config(only_fma, "nf4", 2, 64, 64) is None  # an FMA tiling cannot take 2 rows


def test_merge_replaces_shapes_and_keeps_the_rest():
    base = table(**{"NVIDIA H200": {"torch": "old", **DEVICE}})
    new = table(**{"NVIDIA H200": {"torch": "new", "kinds": {"nf4": {"4096x4096": {"crossover_m": 8, "configs": {
        "1": CFG16}}, "64x64": {"configs": {"1": CFG1}}}}}, "Other GPU": DEVICE})  # fmt: skip
    before = json.dumps(base)
    merged = tuning.merge_tables(base, new)
    h200 = merged["devices"]["NVIDIA H200"]
    assert h200["torch"] == "new" and h200["kinds"]["nf4"]["4096x4096"]["crossover_m"] == 8
    assert set(h200["kinds"]["nf4"]) == {"4096x4096", "64x64"}
    assert merged["devices"]["Other GPU"] == DEVICE
    assert json.dumps(base) == before  # inputs unchanged


def test_write_then_read_round_trips_and_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "small_m.json"
    tuning.write_table(path, table(**{"GPU": DEVICE}))
    assert tuning.read_table(path) == table(**{"GPU": DEVICE})
    assert path.read_text().count("\n") > 5 and '"1": {"use_dot": false' in path.read_text()  # one line per config
    old = path.read_bytes()
    with pytest.raises(ValueError, match="`block_n`"):
        bad = {"kinds": {"nf4": {"8x8": {"configs": {"1": {**CFG1, "block_n": 3}}}}}}
        tuning.write_table(path, table(**{"GPU": bad}))
    monkeypatch.setattr(tuning.os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        tuning.write_table(path, table(**{"GPU": {}}))
    assert path.read_bytes() == old and [p.name for p in path.parent.iterdir()] == ["small_m.json"]


def test_shipped_table_is_valid_and_covers_llama_shapes_on_a_gpu():
    """The shipped table reads, validates (every config builds) and is not empty: it names at least one GPU, with
    both kinds and the Llama-3-8B shapes, each with an M=1 config and a crossover."""
    devices = tuning.read_table(tuning.SHIPPED)["devices"]
    assert devices, "the shipped table lists no GPU"
    for name, entry in devices.items():
        for kind in tuning.KINDS:
            shapes = entry["kinds"][kind]
            assert {"4096x4096", "14336x4096", "4096x14336"} <= set(shapes), (name, kind)
            for shape, shape_entry in shapes.items():
                assert "1" in shape_entry["configs"] and shape_entry["crossover_m"] >= 1, (name, kind, shape)
                n, k = map(int, shape.split("x"))
                assert tuning.lookup_config(entry, kind, 1, n, k).use_dot is False


def test_env_table_is_read_on_top(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(table(**{"My GPU": DEVICE})))
    merged = tuning._merged_devices(str(path))
    assert merged["My GPU"] == DEVICE and set(tuning.read_table(tuning.SHIPPED)["devices"]) < set(merged)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"devices": {}}))
    with pytest.raises(ValueError, match="not a small-M tuning table"):
        tuning._merged_devices(str(bad))


@pytest.mark.parametrize("where, entry, needle", [
    ("kind", {"fp8": {"8x8": {}}}, "kind must be one of"),
    ("crossover", {"nf4": {"8x8": {"crossover_m": -1}}}, "`crossover_m`"),
    ("m", {"nf4": {"8x8": {"configs": {"0": CFG1}}}}, "row counts"),
    ("field", {"nf4": {"8x8": {"configs": {"1": {**CFG1, "blockn": 8}}}}}, "Unknown small-M config field"),
])  # fmt: skip
def test_bad_tables_name_the_entry(where, entry, needle):
    with pytest.raises(ValueError, match=needle):
        tuning.check_table(table(**{"GPU": {"kinds": entry}}), "t.json")


def test_cpu_device_has_no_table():
    assert tuning.tuned_config(torch.device("cpu"), "nf4", 1, 4096, 4096) is None
    assert tuning.tuned_crossover(torch.device("cpu"), "nf4", 4096, 4096) is None


@pytest.mark.parametrize(
    "field, value", [("block_n", 24), ("block_k", 8), ("num_warps", 0), ("split_k", 0), ("num_stages", "2"),
                     ("use_dot", 1), ("factor_scales", None), ("block_m", 8), ("block_m", 48), ("block_m", 32.0),
                     ("block_m", True)]
)  # fmt: skip
def test_bad_config_raises_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"`{field}`"):
        SmallMConfig(**{**CFG16, field: value})


def test_config_json_round_trip_and_effective_split():
    for config in (SmallMConfig(**CFG16), SmallMConfig(**CFG1, factor_scales=False), SmallMConfig(**CFG16, block_m=64)):
        assert SmallMConfig.from_json(json.loads(json.dumps(config.to_json()))) == config
    assert "factor_scales" not in SmallMConfig(**CFG16).to_json()
    assert "block_m" not in SmallMConfig(**CFG16).to_json()  # the shipped tables' entries read unchanged
    assert SmallMConfig(**CFG16, block_m=32).to_json() == {**CFG16, "block_m": 32}
    assert SmallMConfig(**CFG16, block_m=32).rows_per_program == 32
    assert SmallMConfig(**CFG1, block_m=32).rows_per_program == 1  # the CUDA-core path runs one row
    assert tuning.effective_split_k(14336, 1024, 8) == 7  # 14 K-tiles: 2 per split -> 7 splits
    assert tuning.effective_split_k(4096, 512, 16) == 8  # no more splits than K-tiles
