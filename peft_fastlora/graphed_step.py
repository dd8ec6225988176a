"""A training step recorded once as CUDA graphs and replayed: none of the model's Python or launches per step.

At batch 1 (2,048 tokens of an 8-layer Llama-3-8B-shaped model on an H100) a FastLoRA step is bound by host time:
the GPU waits for the Python of the forward, of the checkpointed recompute and of the autograd engine (tens of
thousands of calls a step with checkpointing). Every part of the step is already free of host synchronisation (the
fused loss keeps its divisor on the device, the Triton ops allocate nothing that depends on the data), so the whole
forward + backward is recorded as one graph and the optimizer update as another; a step is then a copy of the batch
into static inputs and one or two graph replays.

What a recording fixes, and how this module keeps it true:

- the batch's keys, shapes and dtypes (checked per call: a different batch raises, naming the key);
- the parameters, the gradients and the optimizer state live at fixed addresses: the step keeps the gradient tensors.
  With one micro-batch per update the recorded backward makes them (autograd adopts each new gradient as ``.grad``,
  which every replay then rewrites in full); with ``accumulation_steps`` it adds into tensors kept from the warm-up and
  the update zeroes them. A parameter replaced (merge, adapter load) or a train/eval switch since
  the recording raises instead of replaying stale work;
- the optimizer's hyperparameters are baked into the update graph, except the learning rate, which becomes a 0-dim
  tensor on the device: LR schedulers (which fill a tensor ``lr`` in place) and plain assignments of a number keep
  working; any other change raises;
- the warm-up runs real steps (Triton compiles, the optimizer's state is created), after which the trainable
  parameters, the optimizer state and the RNG state are put back: the first replayed step is the first step;
- attention stays causal-by-kernel: transformers (5.17 at least) builds the full ``(batch, 1, seq, seq)`` causal
  mask whenever a CUDA stream is capturing, because it cannot read a padding mask then, and hands it to SDPA, which
  then runs its masked kernels (3x the attention time of ``is_causal=True`` on an H100 at 4 x 2,048 tokens: 25.9 vs
  8.5 ms a step). When the batch has no ``attention_mask`` and no ``position_ids`` (no padding, no packing) and no
  sliding window reaches back past the sequence, the mask is the causal one, so the warm-up and the recording run the
  model with an attention implementation that makes no mask and calls transformers' SDPA attention with ``is_causal``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import nn

from ._cuda_graphs import RecordedModel, RngState, record, warm_up
from .block_checkpointing import OFFLOAD_HOOKS
from .fast_path import transformers_model

# Adam and AdamW can run their update inside a CUDA graph (``capturable=True``, fused or not) with their step
# counts on the device and a tensor learning rate; other optimizers either cannot, or create state whose first value
# is not zero (so the warm-up's state could not be reset by zeroing it).
SUPPORTED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW)


class GraphedTrainStep:
    """A training step (forward, backward, optional gradient clipping, optimizer step) recorded once as CUDA graphs and
    replayed for every batch of the same shapes.

    ``step = GraphedTrainStep(model, optimizer, example_batch)`` records; each ``loss = step(batch)`` copies ``batch``
    into the recorded inputs, replays the forward + backward and, every ``accumulation_steps`` calls, the optimizer
    update. Numerics are those of the same eager step (the same kernels run), but
    for an optimizer left to torch's default implementation, whose recorded update is torch's fused one (fp32 math;
    within bf16 rounding of the multi-tensor update, see [`_takes_fused_update`]). Works
    with the fast path ([`enable_fast_path`], activation offload included), gradient checkpointing of either kind,
    LoRA dropout (the RNG advances per replay) and LR schedulers. For fixed-shape batches (pad or pack to one
    sequence length); bf16 or fp32 training (fp16's gradient scaler reads its overflow flag on the host).

    Args:
        model (`nn.Module`): A transformers causal LM or a `PeftModel` wrapping one whose forward returns ``.loss``
            (the batch holds ``labels``), on CUDA, in the mode to train in (``model.train()``).
        optimizer (`torch.optim.Adam` or `torch.optim.AdamW`): Over the trainable parameters. Changed in place for
            the recording: ``capturable=True``, ``fused=True`` where it left ``foreach`` and ``fused`` unset
            (torch's default), and its ``lr`` made a 0-dim tensor on the device.
        example_batch (`Mapping[str, torch.Tensor]`): A batch of the shapes, dtypes and device every later batch will
            have, e.g. ``{"input_ids": ..., "labels": ..., "attention_mask": ...}``; the warm-up trains on it (and is
            then undone).
        accumulation_steps (`int`, *optional*, defaults to 1): Micro-batches per optimizer update; each micro-batch's
            loss is divided by it before backward.
        max_grad_norm (`float`, *optional*): Clip the gradients' total norm to this before each update; the norm
            before clipping is then in ``grad_norm`` after the update.
        autocast_dtype (`torch.dtype`, *optional*): ``torch.bfloat16``: run the forward under ``torch.autocast``
            with it; `None`: no autocast. ``torch.float16`` is refused (see above).
        forward_kwargs (`dict`, *optional*): Constant keyword arguments of every forward (``use_cache=False`` is
            added unless given).
        warmup_steps (`int`, *optional*, defaults to 2): Eager steps before recording (at least 1).
        cuda_graphs (`bool`, *optional*): Record and replay; defaults to `True` on CUDA. With `False` the same step
            runs eagerly on any device (for debugging; nothing is recorded and no warm-up runs).

    Example:

    ```python
    model = get_peft_model(model, FastLoraConfig(r=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    enable_fast_path(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    step = GraphedTrainStep(model, optimizer, next(iter(loader)), autocast_dtype=torch.bfloat16)
    for batch in loader:
        loss = step(batch)
    ```
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        example_batch: Mapping[str, torch.Tensor],
        *,
        accumulation_steps: int = 1,
        max_grad_norm: Optional[float] = None,
        autocast_dtype: Optional[torch.dtype] = None,
        forward_kwargs: Optional[dict[str, Any]] = None,
        warmup_steps: int = 2,
        cuda_graphs: Optional[bool] = None,
    ) -> None:
        _check_arguments(optimizer, accumulation_steps, max_grad_norm, autocast_dtype, warmup_steps)
        self.model, self.optimizer = model, optimizer
        self.accumulation_steps, self.max_grad_norm = accumulation_steps, max_grad_norm
        self.autocast_dtype = autocast_dtype
        self.forward_kwargs = {"use_cache": False, **(forward_kwargs or {})}
        self.grad_norm: Optional[torch.Tensor] = None
        self._params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        if not self._params:
            raise ValueError("`optimizer` holds no parameter that requires grad: nothing to train.")
        device = self._params[0].device
        self._inputs = _static_inputs(example_batch, device)
        self.cuda_graphs = device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        if self.cuda_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs the model on CUDA, its parameters are on {device}; pass "
                             f"cuda_graphs=False (or None) to run the step eagerly.")  # fmt: skip
        self._calls = 0
        self._loss: Optional[torch.Tensor] = None
        self._graphs: Optional[tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]] = None
        if self.cuda_graphs:
            self._record(warmup_steps)

    # ---- one step ----------------------------------------------------------------------------------------------

    def __call__(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Trains on ``batch`` (the example batch's keys, shapes and dtypes); returns its loss (before the division by
        ``accumulation_steps``) as a new 0-dim tensor, without waiting for the GPU."""
        _load_inputs(self._inputs, batch)
        self._calls += 1
        update = self._calls % self.accumulation_steps == 0
        if not self.cuda_graphs:
            loss = self._forward_backward()
            if update:
                self._update()
                self.optimizer.zero_grad(set_to_none=True)
            return loss
        if self._graphs is None:
            raise RuntimeError("this GraphedTrainStep was released; create a new one to train again.")
        self._check_unchanged()
        micro, update_graph = self._graphs
        micro.replay()
        if update:
            update_graph.replay()
        return self._loss.clone()

    def _forward_backward(self) -> torch.Tensor:
        context = (torch.autocast(self._params[0].device.type, dtype=self.autocast_dtype)
                   if self.autocast_dtype is not None else contextlib.nullcontext())  # fmt: skip
        with context:
            out = self.model(**self._inputs, **self.forward_kwargs)
        loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
        if loss is None:
            raise ValueError("the model's forward returned no loss: the batch must hold `labels` (or whatever makes "
                             "the model compute its loss).")  # fmt: skip
        (loss / self.accumulation_steps if self.accumulation_steps > 1 else loss).backward()
        return loss.detach()

    def _update(self) -> None:
        if self.max_grad_norm is not None:
            with_grad = [p for p in self._params if p.grad is not None]
            self.grad_norm = torch.nn.utils.clip_grad_norm_(with_grad, self.max_grad_norm, foreach=True)
        self.optimizer.step()

    # ---- recording ---------------------------------------------------------------------------------------------

    def _record(self, warmup_steps: int) -> None:
        self._lrs = _prepare_optimizer(self.optimizer, self._params[0].device)
        saved = _TrainingState(self._params, self.optimizer)

        def warm_up_steps():
            for _ in range(warmup_steps):
                self._forward_backward()
                self._update()
                self.optimizer.zero_grad(set_to_none=True)
            if self._accumulates:
                self._forward_backward()  # leaves every gradient allocated, where the recording will accumulate them

        # The warm-up runs with the attention the recording will use, so that whatever it compiles (Triton, compiled
        # blocks guarding on the attention implementation) is compiled before recording.
        with causal_attention(self.model, self._inputs):
            stream = warm_up(warm_up_steps)
            saved.restore()
            if self._accumulates:
                torch._foreach_zero_([p.grad for p in self._params if p.grad is not None])
            self._hyper = _hyperparameters(self.optimizer)
            self._retained: list[torch.Tensor] = []  # pinned buffers of the activation offload, replayed into
            hooks = offload_hooks(self.model)
            with hooks.retaining(self._retained) if hooks is not None else contextlib.nullcontext():
                micro = record(self._record_forward_backward, stream)
            # Without accumulation every .grad was None while recording: autograd adopted the backward's own output
            # tensor (in the graph's pool) as each gradient, so a replay neither adds into nor needs zeroed
            # gradients (112 add kernels and a zeroing pass fewer a step on the benchmark model).
            self._grads = [(p, p.grad) for p in self._params if p.grad is not None]
        update = record(self._record_update, stream, pool=micro.pool())
        self._graphs = (micro, update)
        self._recorded_model = RecordedModel(self.model)

    def _record_forward_backward(self) -> None:
        self._loss = self._forward_backward()

    def _record_update(self) -> None:
        self._update()
        if self._accumulates:
            torch._foreach_zero_([g for _, g in self._grads])

    @property
    def _accumulates(self) -> bool:
        """Whether the recorded backward adds into kept gradients (several micro-batches per update) rather than
        making them."""
        return self.accumulation_steps > 1

    def _check_unchanged(self) -> None:
        if not self._recorded_model.unchanged():
            raise RuntimeError("the model changed since the step was recorded (a parameter or buffer replaced, an "
                               "adapter switched, merged or disabled, or train/eval mode changed); create a new "
                               "GraphedTrainStep for the model as it is now.")  # fmt: skip
        for param, grad in self._grads:
            if param.grad is None:  # zero_grad(set_to_none=True): the recorded tensor comes back
                # zeroed where the backward adds into it; otherwise the replay rewrites all of it
                param.grad = grad.zero_() if self._accumulates else grad
            elif param.grad is not grad:
                raise RuntimeError("a parameter's `.grad` was replaced since the step was recorded; the recorded step "
                                   "keeps its own gradient tensors: do not assign `.grad`.")  # fmt: skip
        for group, lr in zip(self.optimizer.param_groups, self._lrs):
            if group["lr"] is not lr:  # a number assigned by hand: into the recorded tensor
                lr.fill_(float(group["lr"]))
                group["lr"] = lr
        if _hyperparameters(self.optimizer) != self._hyper:
            raise RuntimeError("an optimizer hyperparameter other than `lr` changed since the step was recorded (they "
                               "are part of the recorded update); create a new GraphedTrainStep.")  # fmt: skip

    def release(self) -> None:
        """Frees the recorded graphs and their memory; later calls raise."""
        self._graphs = None
        self._retained = []
        self._loss = None


# ---- helpers -----------------------------------------------------------------------------------------------------


def _check_arguments(optimizer, accumulation_steps, max_grad_norm, autocast_dtype, warmup_steps) -> None:
    if not isinstance(optimizer, SUPPORTED_OPTIMIZERS):
        raise TypeError(f"`optimizer` must be a torch.optim.Adam or AdamW (their update can be recorded in a CUDA "
                        f"graph and their warm-up state reset), got {type(optimizer).__name__}; use one of them, or "
                        f"train with an eager loop.")  # fmt: skip
    if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise ValueError(f"`accumulation_steps` must be an int >= 1, got {accumulation_steps!r}.")
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
        raise ValueError(f"`max_grad_norm` must be a positive number or None, got {max_grad_norm!r}.")
    if autocast_dtype == torch.float16:
        raise ValueError("autocast_dtype=torch.float16 needs a gradient scaler, whose step reads its overflow flag on "
                         "the host and cannot be recorded; use torch.bfloat16, or train fp16 with an eager loop.")
    if autocast_dtype not in (None, torch.bfloat16):
        raise ValueError(f"`autocast_dtype` must be torch.bfloat16 or None (no autocast), got {autocast_dtype!r}.")
    if not isinstance(warmup_steps, int) or warmup_steps < 1:
        raise ValueError(f"`warmup_steps` must be an int >= 1 (Triton compiles and the optimizer's state must exist "
                         f"before recording), got {warmup_steps!r}.")  # fmt: skip


def _static_inputs(example_batch: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    if not isinstance(example_batch, Mapping) or not example_batch:
        raise TypeError(f"`example_batch` must be a non-empty mapping of names to tensors (e.g. input_ids, labels), "
                        f"got {type(example_batch).__name__}.")  # fmt: skip
    inputs = {}
    for key, value in example_batch.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"`example_batch[{key!r}]` must be a tensor, got {type(value).__name__}; pass constant "
                            f"arguments in `forward_kwargs`.")  # fmt: skip
        if value.device != device:
            raise ValueError(f"`example_batch[{key!r}]` is on {value.device}, the model's trainable parameters on "
                             f"{device}; move the batch to {device}.")  # fmt: skip
        inputs[key] = value.detach().clone()
    return inputs


def _load_inputs(inputs: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> None:
    if not isinstance(batch, Mapping) or set(batch) != set(inputs):
        got = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise ValueError(f"`batch` must have the keys of the example batch the step was recorded with "
                         f"({sorted(inputs)}), got {got}.")  # fmt: skip
    for key, static in inputs.items():
        value = batch[key]
        if not isinstance(value, torch.Tensor) or value.shape != static.shape or value.dtype != static.dtype:
            got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"`batch[{key!r}]` must be a {static.dtype} tensor of shape {tuple(static.shape)} (the "
                             f"example batch's), got {got}; pad or pack batches to one shape, or record one step per "
                             f"shape.")  # fmt: skip
        static.copy_(value, non_blocking=True)


def _prepare_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> list[torch.Tensor]:
    """Makes the update recordable: ``capturable`` (step counts on the device), torch's fused kernel where the
    optimizer left the choice to torch (see [`_takes_fused_update`]); step counts already made by eager steps moved
    to the device, each group's ``lr`` a 0-dim fp32 tensor on the device (filled in place by LR schedulers). Returns
    those tensors."""
    lrs = []
    for group in optimizer.param_groups:
        if _takes_fused_update(group, device):
            group["fused"] = True
        group["capturable"] = True  # torch refuses to record a step of any other group, fused ones included
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            if isinstance(state.get("step"), torch.Tensor) and state["step"].device != param.device:
                state["step"] = state["step"].to(param.device, torch.float32)
        lr = group["lr"]
        if not (isinstance(lr, torch.Tensor) and lr.device == device):
            group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=device)
        lrs.append(group["lr"])
    return lrs


def _takes_fused_update(group: dict, device: torch.device) -> bool:
    """Whether a recorded update runs ``group`` through torch's fused Adam(W) kernel instead of the multi-tensor one.

    Only where the optimizer was left to pick its implementation (``foreach`` and ``fused`` unset, as by default) and
    every parameter is a floating-point tensor on the recording's CUDA device. There, ``capturable=True`` makes the
    multi-tensor update divide 16-bit moments by its fp32 step-count tensors, which torch's foreach kernels do not take
    together: it falls back to one kernel per parameter and operation. With bf16 adapters that was 336 of the update's
    372 kernels, 1.3 of its 1.6 ms, 1.1 % of the recorded batch-4 step (H200, the benchmark model's 112 adapters).
    The fused kernel makes the same update in one pass, its arithmetic in fp32 (the multi-tensor path rounds each
    intermediate to the parameter's dtype): results within bf16 rounding of the eager update."""
    if device.type != "cuda" or group.get("fused") or group.get("foreach") is not None or group.get("differentiable"):
        return False
    return all(p.device == device and p.is_floating_point() for p in group["params"])


CAUSAL_SDPA = "fastlora_causal_sdpa"


def _causal_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention without the mask: only used where the mask is the plain causal one."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


def _no_mask(*args, **kwargs) -> None:
    return None


@contextlib.contextmanager
def causal_attention(model: nn.Module, inputs: dict[str, torch.Tensor]):
    """Runs a transformers model whose attention is SDPA with [`_causal_sdpa`] (and no mask built) while inside, if the
    batch needs no mask beyond causality; else changes nothing."""
    hf_model = _transformers_model_or_none(model)
    config = None if hf_model is None else hf_model.config
    ids = inputs.get("input_ids", inputs.get("inputs_embeds"))
    if config is None or ids is None or not _plain_causal(config, ids.shape[1], inputs):
        yield
        return
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(CAUSAL_SDPA, _causal_sdpa)  # names in transformers' registries; stateless functions
    AttentionMaskInterface.register(CAUSAL_SDPA, _no_mask)
    config._attn_implementation = CAUSAL_SDPA
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


def _plain_causal(config, seq_len: int, inputs: dict[str, torch.Tensor]) -> bool:
    """Whether every layer's mask is the causal one: SDPA attention, no padding or packing in the batch, every layer
    full attention or a sliding window at least as long as the sequence."""
    if getattr(config, "_attn_implementation", None) != "sdpa" or {"attention_mask", "position_ids"} & set(inputs):
        return False
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and seq_len >= window:
        return False
    layer_types = getattr(config, "layer_types", None) or ()
    return all(kind == "full_attention" for kind in layer_types) or (window is not None and seq_len < window)


def _transformers_model_or_none(model: nn.Module) -> Optional[nn.Module]:
    """The transformers model (under a `PeftModel`), or None for any other module: no fast path, no transformers
    attention to adjust."""
    try:
        return transformers_model(model)
    except TypeError:
        return None


def offload_hooks(model: nn.Module):
    """The model's activation-offload hooks ([`enable_fast_path`] with ``offload_activations``), if any."""
    hf_model = _transformers_model_or_none(model)
    return (model if hf_model is None else hf_model).__dict__.get(OFFLOAD_HOOKS)


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in group.items() if k not in ("params", "lr")} for group in optimizer.param_groups]


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


class _TrainingState:
    """The trainable parameters, the optimizer's state and the RNG states, to put back after the warm-up. State the
    warm-up created (Adam's moments and step count, absent before) is put back to its initial value, zero.

    The copies are kept in CPU memory: on the GPU they would be alive through the warm-up and the recording, the
    step's peak (the adapters of the benchmark model are 21 MB in bf16, their Adam state twice that)."""

    def __init__(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.params = [(p, _host_copy(p)) for p in params]
        self.state = {p: {k: _host_copy(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                      for p, s in optimizer.state.items()}  # fmt: skip
        self.rng = RngState(sorted({p.device.index or 0 for p in params if p.is_cuda}))

    def restore(self) -> None:
        with torch.no_grad():
            for param, value in self.params:
                param.copy_(value)
            for param, state in self.optimizer.state.items():
                before = self.state.get(param, {})
                for key, value in state.items():
                    if not isinstance(value, torch.Tensor):
                        state[key] = before.get(key, value)
                    elif key in before:
                        value.copy_(before[key])
                    else:
                        value.zero_()
        self.rng.restore()
