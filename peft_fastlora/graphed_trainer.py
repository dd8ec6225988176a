"""The Hugging Face Trainer's forward + backward recorded once as a CUDA graph and replayed for every micro-batch of the
same shapes: [`record_trainer_steps`].

[`GraphedTrainStep`] records a whole step, optimizer included, for plain loops. The Trainer runs its own optimizer
step, clipping, LR scheduler and ``zero_grad`` between micro-batches, so here only ``trainer.training_step`` (the
Trainer's forward, loss scaling and backward, as the installed transformers writes it) is recorded; the update stays
the Trainer's, eager, on the gradients the replay leaves in the parameters' ``.grad``. At batch 1 that is where the
host time goes: the model's Python and launches, the checkpointed recompute and the autograd engine.

How it stays correct:

- the first ``warmup_steps`` calls run eagerly (Triton compiles; the optimizer's state is made by the Trainer's own
  steps); the recording happens at the start of an update (every ``.grad`` None: the Trainer zeroed them), after one
  eager pass on a side stream whose gradients are zeroed and whose RNG draws are undone;
- the recorded backward accumulates into the kept gradient tensors, which the wrapper puts back into ``.grad`` (zeroed)
  when the Trainer has set them to None, so gradient accumulation and ``zero_grad(set_to_none=True)`` both work;
- a call the recording does not fit runs the Trainer's own ``training_step``: other batch keys, shapes or dtypes
  (dynamic padding), another accumulation count (the last, shorter window of an epoch), another model object, a
  model changed since the recording (merge, adapter switch, parameter replaced), or gradients held elsewhere;
- what cannot be recorded is refused before training (fp16's gradient scaler, several processes, a model not on CUDA,
  ``torch_empty_cache_steps``) or, if the recording itself fails (a host synchronisation inside the loss), the
  Trainer goes on eagerly with one warning;
- the recording (its graph and memory pool) is freed when ``train()`` returns; a later ``train()`` records again.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import torch

from ._cuda_graphs import RecordedModel, RngState, record, warm_up
from .graphed_step import causal_attention, offload_hooks


@dataclass
class RecordedSteps:
    """What [`record_trainer_steps`] did so far.

    Args:
        replayed (`int`): Micro-batches trained by replaying the recording.
        eager (`int`): Micro-batches trained by the Trainer's own ``training_step`` (warm-up included).
        recordings (`int`): Recordings made (one, unless the model changed and a new one was made).
        last_eager_reason (`str`): Why the last eager call did not replay.
        disabled (`str`): Why recording was given up for this Trainer (empty while it is on).
    """

    replayed: int = 0
    eager: int = 0
    recordings: int = 0
    last_eager_reason: str = ""
    disabled: str = ""


class _Recorder:
    """The wrapper installed as ``trainer.training_step``."""

    def __init__(self, trainer, warmup_steps: int) -> None:
        self.trainer, self.warmup_steps = trainer, warmup_steps
        self.original = trainer.training_step
        self.stats = RecordedSteps()
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.inputs: dict[str, torch.Tensor] = {}
        self.num_items: Optional[torch.Tensor] = None
        self.key: tuple = ()
        self.recorded_model: Optional[RecordedModel] = None
        self.grads: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self.loss: Optional[torch.Tensor] = None
        self.retained: list[torch.Tensor] = []

    # ---- a call ------------------------------------------------------------------------------------------------

    def __call__(self, model, inputs, num_items_in_batch=None):
        reason = self._replay_refusal(model, inputs, num_items_in_batch)
        if reason is None:
            return self._replay(model, inputs, num_items_in_batch)
        if reason == "record":
            try:
                return self._record(model, inputs, num_items_in_batch)
            except Exception as err:  # a host sync or another op that cannot be captured: go on eagerly
                self.release()
                self.stats.disabled = f"recording failed ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
                warnings.warn(f"record_trainer_steps: {self.stats.disabled}; training continues eagerly.",
                              stacklevel=2)  # fmt: skip
                reason = self.stats.disabled
        self.stats.eager += 1
        self.stats.last_eager_reason = reason
        return self.original(model, inputs, num_items_in_batch)

    def _key(self, model, inputs, num_items_in_batch) -> tuple:
        if not isinstance(inputs, Mapping) or not all(isinstance(v, torch.Tensor) for v in inputs.values()):
            return ()
        items = None if num_items_in_batch is None else type(num_items_in_batch).__name__
        accumulation = getattr(self.trainer, "current_gradient_accumulation_steps", None)
        return (id(model), accumulation, items,
                tuple(sorted((k, tuple(v.shape), v.dtype, v.device) for k, v in inputs.items())))  # fmt: skip

    def _replay_refusal(self, model, inputs, num_items_in_batch) -> Optional[str]:
        """None to replay, ``"record"`` to record now, or why this call runs eagerly."""
        if self.stats.disabled:
            return self.stats.disabled
        key = self._key(model, inputs, num_items_in_batch)
        if not key:
            return "the batch is not a mapping of tensors"
        model.train()  # as training_step does, before the recorded train/eval mode is compared
        if self.graph is None:
            if self.stats.eager < self.warmup_steps:
                return "warm-up"
            return "record" if self._grads_free(model) else "waiting for the start of an update (gradients held)"
        if key != self.key:
            return "another batch shape, key set, dtype or accumulation count than the recording's"
        if not self.recorded_model.unchanged():
            self.release()
            return "the model changed since the recording (a new one is made at the next update)"
        if not all(p.grad is None or p.grad is g for p, g in self.grads):
            return "a parameter's .grad was replaced"
        return None

    @staticmethod
    def _grads_free(model) -> bool:
        return all(p.grad is None for p in model.parameters() if p.requires_grad)

    def _load(self, inputs, num_items_in_batch) -> None:
        for key, static in self.inputs.items():
            static.copy_(inputs[key], non_blocking=True)
        if self.num_items is None:
            return
        if isinstance(num_items_in_batch, torch.Tensor):
            self.num_items.copy_(num_items_in_batch.reshape(()), non_blocking=True)
        else:
            self.num_items.fill_(num_items_in_batch)

    def _replay(self, model, inputs, num_items_in_batch) -> torch.Tensor:
        self._load(inputs, num_items_in_batch)
        fresh = [g for p, g in self.grads if p.grad is None]
        if fresh:  # the Trainer zeroed with set_to_none: the kept tensors come back, zeroed
            torch._foreach_zero_(fresh)
            for p, g in self.grads:
                p.grad = g
        self.graph.replay()
        self.stats.replayed += 1
        return self.loss.clone()

    # ---- recording ---------------------------------------------------------------------------------------------

    def _record(self, model, inputs, num_items_in_batch) -> torch.Tensor:
        self.key = self._key(model, inputs, num_items_in_batch)
        self.inputs = {k: v.detach().clone() for k, v in inputs.items()}
        self.num_items = None
        if num_items_in_batch is not None:  # a device tensor, refilled per call (the model divides by it)
            value = torch.as_tensor(num_items_in_batch)
            self.num_items = value.detach().reshape(()).to(next(iter(self.inputs.values())).device, copy=True)

        def step():
            return self.original(model, self.inputs, self.num_items)

        rng = RngState(sorted({p.device.index or 0 for p in model.parameters() if p.is_cuda}))
        with causal_attention(model, self.inputs):
            try:
                stream = warm_up(step)  # real work on a side stream: leaves every gradient allocated
            except Exception:
                for p in model.parameters():  # the start of an update: no gradient yet
                    p.grad = None
                raise
            finally:  # the warm-up's random draws are undone
                rng.restore()
            self.grads = [(p, p.grad) for p in model.parameters() if p.requires_grad and p.grad is not None]
            torch._foreach_zero_([g for _, g in self.grads])
            hooks = offload_hooks(model)
            self.retained = []
            with hooks.retaining(self.retained) if hooks is not None else contextlib.nullcontext():
                self.graph = record(self._record_call(step), stream)
        self.recorded_model = RecordedModel(model)
        self.stats.recordings += 1
        self.graph.replay()  # the recording ran no kernel: this is the call's real step
        self.stats.replayed += 1
        return self.loss.clone()

    def _record_call(self, step):
        def run() -> None:
            self.loss = step()

        return run

    def release(self) -> None:
        self.graph, self.loss, self.retained, self.recorded_model = None, None, [], None
        self.grads, self.inputs = [], {}


def _on_cuda(params: list[torch.nn.Parameter]) -> bool:
    return bool(params) and all(p.is_cuda for p in params)


def record_trainer_steps(trainer, *, warmup_steps: int = 2) -> RecordedSteps:
    """Makes ``trainer`` replay its forward + backward as a CUDA graph: after ``warmup_steps`` eager micro-batches, the
    Trainer's ``training_step`` is recorded once and every later micro-batch of the same shapes replays it (the
    optimizer step, clipping, LR schedule, logging and evaluation stay the Trainer's). For fixed-shape batches: pad
    or pack to one length (``padding="max_length"``, packing); a batch without ``attention_mask`` or
    ``position_ids`` (no padding, no packing boundaries) also gets SDPA's causal kernels in the recording.

    Args:
        trainer (`transformers.Trainer`): A Trainer (or subclass: TRL's `SFTTrainer`) over a model on one CUDA GPU,
            bf16 or fp32 (not fp16: its gradient scaler reads an overflow flag on the host).
        warmup_steps (`int`, *optional*, defaults to 2): Eager micro-batches before recording (Triton compiles, the
            optimizer state exists).

    Returns:
        [`RecordedSteps`]: Counters of replayed and eager micro-batches, updated as training runs.

    Example:

    ```python
    trainer = Trainer(model=model, args=TrainingArguments(..., bf16=True), train_dataset=packed)
    steps = peft_fastlora.record_trainer_steps(trainer)
    trainer.train()
    print(steps)  # RecordedSteps(replayed=..., eager=2, recordings=1, ...)
    ```
    """
    if not isinstance(warmup_steps, int) or warmup_steps < 1:
        raise ValueError(f"`warmup_steps` must be an int >= 1 (Triton compiles and the optimizer's state must exist "
                         f"before recording), got {warmup_steps!r}.")  # fmt: skip
    if not callable(getattr(trainer, "training_step", None)) or not hasattr(trainer, "args"):
        raise TypeError(f"`trainer` must be a transformers Trainer, got {type(trainer).__name__}.")
    if isinstance(trainer.training_step, _Recorder):
        raise ValueError("`trainer` already records its steps (record_trainer_steps was called on it before).")
    args = trainer.args
    problems = []
    if getattr(args, "fp16", False):
        problems.append("fp16=True (the gradient scaler reads its overflow flag on the host each step; use bf16=True)")
    if getattr(args, "torch_empty_cache_steps", None):
        problems.append("torch_empty_cache_steps is set (emptying the cache inside the step cannot be recorded)")
    if getattr(args, "world_size", 1) > 1 or getattr(args, "n_gpu", 1) > 1:
        problems.append("training runs on several processes or GPUs (record one GPU's step only)")
    if not _on_cuda([p for p in trainer.model.parameters() if p.requires_grad]):
        problems.append("the model's trainable parameters are not all on a CUDA GPU")
    if problems:
        raise ValueError("record_trainer_steps cannot record this Trainer's steps: " + "; ".join(problems) + ".")
    recorder = _Recorder(trainer, warmup_steps)
    trainer.training_step = recorder
    trainer.add_callback(_release_at_train_end(recorder))
    return recorder.stats


def _release_at_train_end(recorder: _Recorder):
    """A callback that frees the recording (its graph and memory pool) when ``train()`` returns: evaluation or
    generation after training get that memory back, and a later ``train()`` records again."""
    from transformers import TrainerCallback

    class ReleaseRecording(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            recorder.release()

    return ReleaseRecording()
