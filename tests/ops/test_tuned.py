"""The small-M tuning tables (``peft_fastlora/ops/tuned.py``): format checks, merging, lookups, bad configs."""

import json

import pytest
import torch

from peft_fastlora.ops import tuned
from peft_fastlora.ops.fused_small_m import SmallMConfig, heuristic_config, pick_config

CFG1 = {"use_dot": False, "block_n": 8, "block_k": 1024, "split_k": 1, "num_warps": 4, "num_stages": 1}
CFG16 = {"use_dot": True, "block_n": 64, "block_k": 128, "split_k": 7, "num_warps": 4, "num_stages": 1}
DEVICE = {"kinds": {"nf4": {"4096x4096": {"crossover_m": 24, "configs": {"1": CFG1, "16": CFG16}}}}}


def test_lookup_takes_smallest_tabled_m_at_or_above():
    assert tuned.lookup_config(DEVICE, "nf4", 1, 4096, 4096) == CFG1
    assert tuned.lookup_config(DEVICE, "nf4", 9, 4096, 4096) == CFG16
    assert tuned.lookup_config(DEVICE, "nf4", 40, 4096, 4096) == CFG16  # beyond the table: its largest M
    assert tuned.lookup_crossover(DEVICE, "nf4", 4096, 4096) == 24


def test_lookup_misses_return_none():
    assert tuned.lookup_config(DEVICE, "int8", 1, 4096, 4096) is None
    assert tuned.lookup_config(DEVICE, "nf4", 1, 4096, 14336) is None
    assert tuned.lookup_crossover(DEVICE, "nf4", 14336, 4096) is None
    assert tuned.lookup_config({}, "nf4", 1, 4096, 4096) is None
    only_fma = {"kinds": {"nf4": {"64x64": {"configs": {"1": CFG1}}}}}
    assert tuned.lookup_config(only_fma, "nf4", 2, 64, 64) is None  # an FMA tiling cannot take 2 rows


def test_merge_replaces_shapes_and_keeps_the_rest():
    extra = {"NVIDIA H200": {"kinds": {"nf4": {"4096x4096": {"crossover_m": 8, "configs": {"1": CFG16}}}}},
             "Other GPU": DEVICE}
    merged = tuned.merge_tables({"NVIDIA H200": json.loads(json.dumps(DEVICE))}, extra)
    assert merged["NVIDIA H200"]["kinds"]["nf4"]["4096x4096"]["crossover_m"] == 8
    assert merged["Other GPU"] == DEVICE


def test_shipped_table_is_valid_and_its_configs_build():
    table = tuned._read(tuned.SHIPPED)
    for entry in table.values():
        for shapes in entry["kinds"].values():
            for shape in shapes.values():
                for config in shape["configs"].values():
                    SmallMConfig(**config)


def test_env_table_is_read_on_top(tmp_path, monkeypatch):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"format": 1, "devices": {"My GPU": DEVICE}}))
    assert tuned._table(str(path))["My GPU"] == DEVICE
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"devices": {}}))
    with pytest.raises(ValueError, match="not a small-M tuning table"):
        tuned._table(str(bad))


def test_cpu_device_uses_heuristic():
    device = torch.device("cpu")
    assert tuned.tuned_config(device, "nf4", 1, 4096, 4096) is None
    assert pick_config(1, 96, 64, device) == heuristic_config(1, 96, 64, device)


@pytest.mark.parametrize(
    "field, value", [("block_n", 24), ("block_k", 8), ("num_warps", 0), ("split_k", 0), ("num_stages", "2")]
)
def test_bad_config_raises_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"`{field}`"):
        SmallMConfig(**{**CFG16, field: value})
