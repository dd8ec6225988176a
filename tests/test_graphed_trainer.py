"""``record_trainer_steps``: the Trainer's forward + backward recorded once and replayed.

On CPU the CUDA-graph calls are replaced by stand-ins that keep a graph's semantics for this wrapper (a recording runs
nothing; a replay runs the recorded function again, on the same static inputs and gradient tensors), so what the
wrapper decides (warm-up, when to record, what replays, what runs eagerly, how gradients accumulate across
micro-batches and survive ``zero_grad``) is tested against the Trainer's own eager run. The GPU tests record real
graphs.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainingArguments

import peft_fastlora
from peft_fastlora import graphed_trainer
from tests.utils import TINY_LLAMA, fast_config, load_quantized

STEPS = 6


class _FakeGraph:
    def __init__(self, function):
        self.function = function

    def replay(self):
        self.function()


@pytest.fixture
def fake_graphs(monkeypatch):
    """CPU stand-ins for the side-stream warm-up and the recording; counts recordings and replays."""
    counts = {"warm_up": 0, "record": 0}

    def warm_up(function):
        counts["warm_up"] += 1
        function()

    def record(function, stream, pool=None):
        counts["record"] += 1
        return _FakeGraph(function)

    monkeypatch.setattr(graphed_trainer, "warm_up", warm_up)
    monkeypatch.setattr(graphed_trainer, "record", record)
    monkeypatch.setattr(graphed_trainer, "_on_cuda", lambda params: bool(params))
    return counts


def _model(path, device="cpu"):
    torch.manual_seed(5)
    model = get_peft_model_fast(path, device)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    return model


def get_peft_model_fast(path, device):
    from peft import get_peft_model

    return get_peft_model(load_quantized(path, device=device), fast_config(lora_alpha=8))


def _dataset(lengths=(16,), rows=24):
    g = torch.Generator().manual_seed(0)
    data = []
    for i in range(rows):
        ids = torch.randint(3, TINY_LLAMA["vocab_size"], (lengths[i % len(lengths)],), generator=g)
        data.append({"input_ids": ids, "labels": ids})
    return data


def _trainer(model, tmp_path, device="cpu", dataset=None, **overrides):
    args = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                max_steps=STEPS, learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                disable_tqdm=True, use_cpu=device == "cpu", bf16=device != "cpu", seed=0, max_grad_norm=1.0,
                dataloader_drop_last=True)  # fmt: skip
    args.update(overrides)
    return Trainer(model=model, args=TrainingArguments(**args), train_dataset=dataset or _dataset())


def _run(trainer):
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    norms = [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]
    adapters = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return losses, norms, adapters


@pytest.mark.parametrize("fast_path, ckpt", [(False, False), (True, False), (True, True)],
                         ids=["plain", "fast-path", "fast-path-checkpointing"])  # fmt: skip
def test_replayed_steps_train_like_the_trainer(tiny_llama_path, tmp_path, fake_graphs, fast_path, ckpt):
    """Two micro-batches per update, clipping, AdamW (with the fast path's fused loss and MLP, and with gradient
    checkpointing): after two eager warm-up micro-batches the step is recorded at the start of an update and replayed
    for every later micro-batch; losses, gradient norms and the trained adapters are the Trainer's own."""

    def model():
        made = _model(tiny_llama_path)
        if fast_path:
            peft_fastlora.enable_fast_path(made, liger=False)
        return made

    options = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}) if ckpt else {}
    eager = _run(_trainer(model(), tmp_path / "eager", **options))
    trainer = _trainer(model(), tmp_path / "recorded", **options)
    stats = peft_fastlora.record_trainer_steps(trainer)
    recorded = _run(trainer)
    assert stats.recordings == 1 and fake_graphs == {"warm_up": 1, "record": 1}
    assert stats.eager == 2 and stats.replayed == 2 * STEPS - 2 and not stats.disabled
    torch.testing.assert_close(recorded[0], eager[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(recorded[1], eager[1], atol=1e-6, rtol=1e-6)
    for name, value in eager[2].items():
        torch.testing.assert_close(recorded[2][name], value, atol=1e-6, rtol=1e-6, msg=name)


def test_the_recording_is_freed_when_training_ends_and_made_again(tiny_llama_path, tmp_path, fake_graphs):
    """``train()`` returning frees the graph and its memory; the next ``train()`` records again after its first
    update starts (the warm-up is not repeated)."""
    trainer = _trainer(_model(tiny_llama_path), tmp_path)
    stats = peft_fastlora.record_trainer_steps(trainer)
    _run(trainer)
    recorder = trainer.training_step
    assert stats.recordings == 1 and recorder.graph is None and recorder.grads == [] and recorder.inputs == {}
    trainer.args.max_steps = 2 * STEPS
    trainer.train()  # from step 0 again: 2 * STEPS updates of two micro-batches, all replayed
    assert stats.recordings == 2 and stats.eager == 2 and stats.replayed == (2 * STEPS - 2) + 2 * (2 * STEPS)


def test_batches_of_other_shapes_run_eagerly(tiny_llama_path, tmp_path, fake_graphs):
    """Dynamic padding: micro-batches of another length than the recording's take the Trainer's own step."""
    data = _dataset(lengths=(16, 12))  # one row per micro-batch, rows of two lengths in shuffled order
    trainer = _trainer(_model(tiny_llama_path), tmp_path, dataset=data, per_device_train_batch_size=1)
    stats = peft_fastlora.record_trainer_steps(trainer)
    _run(trainer)
    assert stats.recordings == 1 and stats.replayed > 0 and stats.eager > 2
    assert stats.replayed + stats.eager == 2 * STEPS
    assert "shape" in stats.last_eager_reason


def test_a_recording_that_fails_warns_and_trains_eagerly(tiny_llama_path, tmp_path, fake_graphs, monkeypatch):
    """A loss that synchronises with the host cannot be recorded: one warning, and the Trainer's own step from then
    on, with the Trainer's results."""
    def failing_record(function, stream, pool=None):
        raise RuntimeError("operation not permitted when stream is capturing\n(more)")

    monkeypatch.setattr(graphed_trainer, "record", failing_record)
    eager = _run(_trainer(_model(tiny_llama_path), tmp_path / "eager"))
    trainer = _trainer(_model(tiny_llama_path), tmp_path / "recorded")
    stats = peft_fastlora.record_trainer_steps(trainer)
    with pytest.warns(UserWarning, match="recording failed .*not permitted when stream is capturing"):
        recorded = _run(trainer)
    assert stats.replayed == 0 and stats.eager == 2 * STEPS and "recording failed" in stats.disabled
    torch.testing.assert_close(recorded[0], eager[0], atol=1e-6, rtol=1e-6)


def test_what_cannot_be_recorded_is_refused(tiny_llama_path, tmp_path):
    model = _model(tiny_llama_path)
    with pytest.raises(ValueError, match="not all on a CUDA GPU"):
        peft_fastlora.record_trainer_steps(_trainer(model, tmp_path))
    with pytest.raises(ValueError, match="torch_empty_cache_steps"):
        peft_fastlora.record_trainer_steps(_trainer(model, tmp_path, torch_empty_cache_steps=4))
    with pytest.raises(ValueError, match="`warmup_steps` must be an int >= 1"):
        peft_fastlora.record_trainer_steps(_trainer(model, tmp_path), warmup_steps=0)
    with pytest.raises(TypeError, match="must be a transformers Trainer"):
        peft_fastlora.record_trainer_steps(object())


def test_recording_twice_is_refused(tiny_llama_path, tmp_path, fake_graphs):
    trainer = _trainer(_model(tiny_llama_path), tmp_path)
    peft_fastlora.record_trainer_steps(trainer)
    with pytest.raises(ValueError, match="already records"):
        peft_fastlora.record_trainer_steps(trainer)


@pytest.mark.gpu
def test_gpu_recorded_trainer_matches_eager(tiny_llama_path, tmp_path):
    """Real CUDA graphs, bf16: the replayed micro-batches give the eager Trainer's losses, gradient norms and
    adapters within bf16 rounding."""
    eager = _run(_trainer(_model(tiny_llama_path, "cuda"), tmp_path / "eager", "cuda"))
    trainer = _trainer(_model(tiny_llama_path, "cuda"), tmp_path / "recorded", "cuda")
    stats = peft_fastlora.record_trainer_steps(trainer)
    recorded = _run(trainer)
    assert stats.recordings == 1 and stats.replayed == 2 * STEPS - 2, stats
    torch.testing.assert_close(recorded[0], eager[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(recorded[1], eager[1], atol=2e-2, rtol=5e-2)
    for name, value in eager[2].items():
        torch.testing.assert_close(recorded[2][name], value, atol=2e-2, rtol=2e-2, msg=name)


@pytest.mark.gpu
def test_gpu_a_loss_that_syncs_with_the_host_falls_back(tiny_llama_path, tmp_path):
    """A ``compute_loss`` that reads a value on the host (``.item()``) cannot be captured: the recording fails, one
    warning, and training goes on eagerly to the eager Trainer's results."""

    class SyncingTrainer(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            self.seen = float(loss.detach().float().item())  # a host sync
            return loss

    def trainer(path):
        base = _trainer(_model(tiny_llama_path, "cuda"), path, "cuda")
        return SyncingTrainer(model=base.model, args=base.args, train_dataset=base.train_dataset)

    eager = _run(trainer(tmp_path / "eager"))
    recording = trainer(tmp_path / "recorded")
    stats = peft_fastlora.record_trainer_steps(recording)
    with pytest.warns(UserWarning, match="recording failed"):
        recorded = _run(recording)
    assert stats.replayed == 0 and stats.disabled
    torch.testing.assert_close(recorded[0], eager[0], atol=1e-3, rtol=1e-3)
    # the device's RNG works (a failed capture left it in capture mode before `_cuda_graphs.record` restored it)
    torch.nn.functional.dropout(torch.randn(64, device="cuda"), 0.5)


@pytest.mark.gpu
def test_gpu_a_capture_that_fails_leaves_the_rng_usable():
    """An exception inside a recording (after a random op was captured) must not leave the device's generator in
    capture mode, where every later random op raises."""
    from peft_fastlora._cuda_graphs import record, warm_up

    def step():
        torch.randn(16, device="cuda")

    def failing():
        step()
        raise ValueError("boom")

    stream = warm_up(step)
    with pytest.raises(ValueError, match="boom"):
        record(failing, stream)
    torch.randn(16, device="cuda")
    torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5)
