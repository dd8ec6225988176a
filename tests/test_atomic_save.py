"""``save_pretrained`` over a good adapter: a save that fails midway (an exception, a full disk, SIGKILL) leaves the
previous files byte-identical and loadable; a save that succeeds replaces what it writes and keeps everything else."""

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict

import peft_fastlora
from peft_fastlora import _atomic
from tests.utils import load_quantized

REPO = Path(__file__).resolve().parents[1]
USER_TEXT = "Notes the user wrote in the card, outside the FastLoRA section."


def fast_config(**kwargs):
    return peft_fastlora.FastLoraConfig(
        **{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM",
           "init_lora_weights": False, **kwargs}
    )


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.parent.iterdir() if _atomic.STAGING_MARK in p.name]


def adapter_state(model, name="default"):
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model, adapter_name=name).items()}


def perturb(model) -> None:
    """Changes every adapter weight, so that a new save differs from the old one in every tensor."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param))


def assert_loads(tiny_llama_path, folder: Path, expected: dict, subfolder=None):
    model = PeftModel.from_pretrained(load_quantized(tiny_llama_path), folder, subfolder=subfolder)
    got = get_peft_model_state_dict(model)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], v) for k, v in expected.items())


@pytest.fixture
def saved(tiny_llama_path, tmp_path):
    """A model with two adapters, saved once (the good adapter), plus a user file and user text in the card."""
    torch.manual_seed(0)
    model = get_peft_model(load_quantized(tiny_llama_path), fast_config())
    model.add_adapter("second", fast_config(r=2, adapter_dtype="fp32"))
    folder = tmp_path / "adapter"
    model.save_pretrained(folder)
    (folder / "notes.txt").write_text("keep me")
    readme = folder / "README.md"
    readme.write_text(readme.read_text() + "\n" + USER_TEXT + "\n")
    old = {"default": adapter_state(model), "second": adapter_state(model, "second")}
    perturb(model)
    return model, folder, snapshot(folder), old


def full_disk(obj, path, *args, **kwargs):
    """A weight writer that writes part of the file, then finds the disk full."""
    Path(path).write_bytes(b"\0" * 100)
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("safe_serialization", [True, False])
def test_full_disk_while_writing_weights_keeps_the_old_adapter(saved, tiny_llama_path, monkeypatch,
                                                                safe_serialization):
    import peft.peft_model

    model, folder, before, old = saved
    if safe_serialization:
        monkeypatch.setattr(peft.peft_model, "safe_save_file", full_disk)
    else:
        monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        model.save_pretrained(folder, safe_serialization=safe_serialization)
    assert snapshot(folder) == before
    assert not leftovers(folder)
    monkeypatch.undo()
    assert_loads(tiny_llama_path, folder, old["default"])
    assert_loads(tiny_llama_path, folder, old["second"], subfolder="second")


def test_failure_after_the_weights_keeps_the_old_adapter(saved, tiny_llama_path, monkeypatch):
    """The weights of both adapters are written, then writing the second adapter's config fails: nothing moves."""
    model, folder, before, old = saved
    config_cls = type(model.peft_config["second"])
    original = config_cls.save_pretrained

    def save_config(self, save_directory, **kwargs):
        if Path(save_directory).name == "second":
            raise KeyboardInterrupt  # Ctrl-C
        return original(self, save_directory, **kwargs)

    monkeypatch.setattr(config_cls, "save_pretrained", save_config)
    with pytest.raises(KeyboardInterrupt):
        model.save_pretrained(folder)
    assert snapshot(folder) == before
    assert not leftovers(folder)
    monkeypatch.undo()
    assert_loads(tiny_llama_path, folder, old["default"])


def test_failure_in_the_card_keeps_the_old_adapter(saved, monkeypatch):
    """The card is part of the save: a card writer that dies (not one that warns) leaves the old files."""
    model, folder, before, _ = saved
    monkeypatch.setattr(peft_fastlora.model_card, "collect_card_facts",
                        lambda *a, **k: (_ for _ in ()).throw(SystemExit(1)))
    with pytest.raises(SystemExit):
        model.save_pretrained(folder)
    assert snapshot(folder) == before


KILL_SCRIPT = """
import os, signal, sys
from pathlib import Path
import torch
import peft.peft_model
from peft import get_peft_model
import peft_fastlora
from tests.utils import load_quantized

def killed_mid_write(tensors, path, *args, **kwargs):
    Path(path).write_bytes(b"\\0" * 64)  # a partial file, then the process dies without any cleanup
    os.kill(os.getpid(), signal.SIGKILL)

torch.manual_seed(1)
config = peft_fastlora.FastLoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
model = get_peft_model(load_quantized(Path(sys.argv[1])), config)
peft.peft_model.safe_save_file = killed_mid_write
model.save_pretrained(sys.argv[2])
"""


def test_sigkill_mid_save_keeps_the_old_adapter(saved, tiny_llama_path):
    _, folder, before, old = saved
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(tiny_llama_path), str(folder)], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert snapshot(folder) == before
    assert_loads(tiny_llama_path, folder, old["default"])
    # the killed process could not clean up: its temporary folder is left beside the adapter, clearly named
    assert len(leftovers(folder)) == 1 and leftovers(folder)[0].startswith(".adapter.peft-fastlora-tmp-")


# ---- successful saves ----------------------------------------------------------------------------------------------
def test_save_over_an_adapter_replaces_it_and_keeps_other_files(saved, tiny_llama_path):
    model, folder, before, _ = saved
    model.save_pretrained(folder)
    after = snapshot(folder)
    assert after["notes.txt"] == b"keep me"
    readme = after["README.md"].decode()
    assert USER_TEXT in readme and readme.count("## Using this adapter") == 1
    assert after["adapter_model.safetensors"] != before["adapter_model.safetensors"]
    assert not leftovers(folder)
    assert_loads(tiny_llama_path, folder, adapter_state(model))
    assert_loads(tiny_llama_path, folder, adapter_state(model, "second"), subfolder="second")


def test_selected_adapters_only_replaces_those(saved, tiny_llama_path):
    model, folder, before, old = saved
    model.save_pretrained(folder, selected_adapters=["second"])
    after = snapshot(folder)
    for name in ("adapter_model.safetensors", "adapter_config.json", "notes.txt"):
        assert after[name] == before[name], name
    assert after["second/adapter_model.safetensors"] != before["second/adapter_model.safetensors"]
    assert_loads(tiny_llama_path, folder, old["default"])
    assert_loads(tiny_llama_path, folder, adapter_state(model, "second"), subfolder="second")


def test_pickle_save_over_safetensors_removes_the_stale_safetensors(saved, tiny_llama_path):
    """PEFT loads adapter_model.safetensors whenever it exists: left beside the new .bin, it would win silently."""
    model, folder, _, _ = saved
    model.save_pretrained(folder, safe_serialization=False)
    names = set(snapshot(folder))
    assert {"adapter_model.bin", "second/adapter_model.bin"} <= names
    assert not {"adapter_model.safetensors", "second/adapter_model.safetensors"} & names
    assert_loads(tiny_llama_path, folder, adapter_state(model))
    model.save_pretrained(folder)  # and back
    names = set(snapshot(folder))
    assert "adapter_model.safetensors" in names and "adapter_model.bin" not in names


def test_save_to_a_new_folder_has_normal_permissions(tiny_llama_path, tmp_path):
    model = get_peft_model(load_quantized(tiny_llama_path), fast_config())
    folder = tmp_path / "new" / "adapter"
    model.save_pretrained(folder)
    umask = os.umask(0)
    os.umask(umask)
    assert folder.stat().st_mode & 0o777 == 0o777 & ~umask
    assert set(snapshot(folder)) == {"adapter_config.json", "adapter_model.safetensors", "README.md"}
    assert not leftovers(folder)


def test_save_to_a_file_is_refused(tiny_llama_path, tmp_path):
    model = get_peft_model(load_quantized(tiny_llama_path), fast_config())
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        model.save_pretrained(tmp_path / "file")
    assert (tmp_path / "file").read_text() == "x"


def test_commit_refuses_conflicts_before_moving_anything(tmp_path):
    dst, staging = tmp_path / "dst", tmp_path / "staging"
    (dst / "b").mkdir(parents=True)
    (dst / "a").write_text("old a")
    (staging / "b").mkdir(parents=True)
    (staging / "a").write_text("new a")
    (staging / "c").mkdir()
    (staging / "c" / "x").write_text("x")
    (dst / "c").write_text("a file where a folder is needed")
    with pytest.raises(FileExistsError, match="is a file"):
        _atomic.commit(staging, dst)
    assert (dst / "a").read_text() == "old a"


def test_non_main_process_writes_nothing(tiny_llama_path, tmp_path):
    model = get_peft_model(load_quantized(tiny_llama_path), fast_config())
    model.save_pretrained(tmp_path / "rank1", is_main_process=False)
    assert not [p for p in (tmp_path / "rank1").rglob("*") if p.is_file()]
    assert not leftovers(tmp_path / "rank1")


def test_commit_removes_superseded_and_stale_files_only(tmp_path):
    dst, staging = tmp_path / "dst", tmp_path / "staging"
    dst.mkdir()
    staging.mkdir()
    for name in ("adapter_model.bin", "a", "d", "model-00001-of-00002.safetensors", "notes.txt"):
        (dst / name).write_text("old")
    (staging / "adapter_model.safetensors").write_text("new")
    (staging / "model.safetensors").write_text("new")
    _atomic.commit(staging, dst, stale=("model*.safetensors",))
    assert sorted(p.name for p in dst.iterdir()) == ["a", "adapter_model.safetensors", "d", "model.safetensors",
                                                     "notes.txt"]
    assert (dst / "model.safetensors").read_text() == "new" and not staging.exists()


def test_save_into_a_folder_whose_parent_is_read_only(saved, tiny_llama_path, monkeypatch):
    """Saving into "." under a read-only parent: the temporary folder goes inside the destination instead."""
    model, folder, _, _ = saved
    original_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self.parent == folder.parent and self.name.startswith(f".{folder.name}{_atomic.STAGING_MARK}"):
            raise PermissionError(13, "Permission denied", str(self))
        return original_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    model.save_pretrained(folder)
    monkeypatch.undo()
    assert not [p.name for p in folder.iterdir() if _atomic.STAGING_MARK in p.name] and not leftovers(folder)
    assert_loads(tiny_llama_path, folder, adapter_state(model))
    assert (folder / "notes.txt").read_text() == "keep me"


def test_destination_of_names_the_folder_a_staging_folder_stands_for(tmp_path):
    beside = _atomic.staging_folder(tmp_path / "adapter")
    assert _atomic.destination_of(beside) == (tmp_path / "adapter").resolve()
    inside = tmp_path / "adapter" / f".adapter{_atomic.STAGING_MARK}0123abcd"  # the read-only-parent fallback
    assert _atomic.destination_of(inside) == tmp_path / "adapter"
    assert _atomic.destination_of(tmp_path / "plain") == tmp_path / "plain"
