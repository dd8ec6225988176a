"""The whole-step fast path: what a FastLoRA training step needs beyond the LoRA linears.

[`enable_fast_path`] applies, to a (quantized, PEFT-wrapped or not yet wrapped) transformers model:

- **the fused loss** (``fused_loss.py``): the LM head and cross-entropy in chunks of rows, so the fp32 logits are never
  materialised, with chunks large enough that a 150k-vocabulary head is not re-read dozens of times a step;
- **Liger-Kernel** (optional extra ``peft-fastlora[fast]``): where the decoder blocks stay eager, its RMSNorm / RoPE
  kernels (and SwiGLU where the fused MLP does not apply); its fused linear cross-entropy when asked for by name or
  where the fused loss does not apply;
- **regional compilation** (opt-in): ``torch.compile`` of each decoder block for training (the FastLoRA layers inside
  reach their Triton kernels through ``torch.ops.peft_fastlora``, so a block compiles without graph breaks); when
  blocks are compiled, inductor fuses RMSNorm, RoPE and SiLU-mul itself and Liger is left out (but for its loss, when
  that is asked for instead of the fused loss): Liger's RMSNorm
  and SwiGLU kernels call ``.to()`` on float arguments that torch 2.11's Triton-kernel analysis passes as constants
  (the "'float' object has no attribute 'to'" error), and its RoPE is excluded from compilation (a graph break);
- **checkpointing per block** (``block_checkpointing.py``): with gradient checkpointing on, the last decoder block is
  not recomputed (its backward follows the loss at once); opt-in, the tensors that checkpointing keeps between blocks
  go to pinned CPU memory on a side stream and come back for the backward pass.

Everything is per model instance except what Liger itself patches at module level (its RoPE function for the model's
architecture), and the dynamo recompile limit, which is raised (never lowered) so that every block keeps its compiled
code. Numerics are those of the same ops in bf16: the loss agrees with plain FastLoRA within bf16 rounding.
"""

from __future__ import annotations

import functools
import inspect
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import MethodType
from typing import Any, Optional, Union

import torch
from torch import nn

from ._forward import set_instance_forward
from .block_checkpointing import apply_checkpoint_policy
from .fast_norms import apply_rms_norms
from .fused_loss import apply_fused_loss, fused_loss_refusal, plain_head
from .ops import LoraProjection, grouped_lora_mlp, lora_mlp, lora_mlp_fusable, swiglu_lora_linear
from .projection_group import group_projections as group_projections_of
from .projection_group import grouped, plain_lora_projections

logger = logging.getLogger(__name__)

FAST_EXTRA_HINT = 'pip install "peft-fastlora[fast]"  (or: pip install liger-kernel)'
# Set on a block whose forward the fast path replaced; holds the class forward it compiled.
_COMPILED_MARK = "_fastlora_compiled_forward"


@dataclass
class FastPathReport:
    """What [`enable_fast_path`] applied to a model.

    Args:
        model_type (`str`): The transformers ``model_type`` of the model.
        liger_kernels (`list[str]`): The Liger-Kernel kernels applied (empty: none).
        compiled_blocks (`int`): How many decoder blocks run compiled.
        fused_mlps (`int`): How many SwiGLU MLPs train with the fused down projection (``fuse_mlp``).
        projection_groups (`int`): How many q/k/v and gate/up projection sets train as one op
            (``group_projections``).
        fused_loss (`bool`): Whether training forwards compute the LM head and loss with the fused loss.
        rms_norms (`int`): How many of Liger's RMSNorms train through ``ops.rms_norm`` (``fast_norms.py``).
        offload_activations (`bool`): Whether checkpointed activations go to CPU memory.
        last_block_kept (`bool`): Whether gradient checkpointing leaves the last decoder block's activations in place
            instead of recomputing them (``recompute_last_block=False``, on models with checkpointable blocks).
        notes (`list[str]`): Why something asked for was not applied.
    """

    model_type: str
    liger_kernels: list[str] = field(default_factory=list)
    compiled_blocks: int = 0
    offload_activations: bool = False
    last_block_kept: bool = False
    fused_mlps: int = 0
    projection_groups: int = 0
    fused_loss: bool = False
    rms_norms: int = 0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        liger = ", ".join(self.liger_kernels) if self.liger_kernels else "none"
        text = (f"FastLoRA fast path on {self.model_type}: fused loss: {'on' if self.fused_loss else 'off'}; "
                f"Liger kernels: {liger}; RMSNorms with the row-wise backward: {self.rms_norms}; "
                f"fused SwiGLU MLPs: {self.fused_mlps}; "
                f"projection groups: {self.projection_groups}; "
                f"compiled decoder blocks: {self.compiled_blocks}; "
                f"activation offload: {'on' if self.offload_activations else 'off'}; "
                f"last block recomputed under checkpointing: {'no' if self.last_block_kept else 'yes'}")
        return text + "".join(f"; {note}" for note in self.notes)


# The Liger-Kernel kernels the fast path knows, by the keyword of Liger's ``apply_liger_kernel_to_*`` functions.
LIGER_KERNELS = ("fused_linear_cross_entropy", "rope", "rms_norm", "swiglu", "geglu")


def enable_fast_path(
    model: nn.Module,
    *,
    liger: Union[bool, str, Sequence[str]] = "auto",
    compile_blocks: bool = False,
    offload_activations: bool = False,
    recompute_last_block: bool = False,
    fuse_mlp: Union[bool, str] = True,
    group_projections: bool = True,
    fused_loss: bool = True,
    compile_options: Optional[dict[str, Any]] = None,
) -> FastPathReport:
    """Applies the whole-step fast path to ``model`` in place (call it before training; before or after
    ``get_peft_model``).

    Args:
        model (`nn.Module`): A transformers causal LM, or a `PeftModel` wrapping one.
        liger (`bool`, `"auto"` or a sequence of kernel names, defaults to `"auto"`): Use Liger-Kernel. `"auto"`: if it
            is installed and supports the architecture, else one warning saying why and the step runs without it.
            `True`: raise instead. A sequence (names from ``LIGER_KERNELS``, e.g. ``["fused_linear_cross_entropy"]``):
            only those kernels, raising like `True`.
        compile_blocks (`bool`, defaults to `False`): ``torch.compile`` each decoder block for training (evaluation and
            generation stay eager). Off by default: on an H100 (Llama-3-8B-shaped, seq 2048) compiled blocks measured
            0.80x the eager Liger step at batch 1 and 0.99x at batch 4 (docs/fast-path.md).
        offload_activations (`bool`, defaults to `False`): With gradient checkpointing, keep the checkpointed block
            inputs in pinned CPU memory (copied on a side stream). Trades PCIe traffic for GPU memory.
        recompute_last_block (`bool`, defaults to `False`): With gradient checkpointing, checkpoint the last decoder
            block like the others. Off by default: that block's backward runs right after the loss, so its recompute
            repeats the forward that just ran; kept, its activations are live during the loss too. On an H100
            (Llama-3-8B-shaped, 8 layers, seq 2048) that made the batch-4 step 1.04x faster for 0-63 MB more peak
            memory (docs/fast-path.md). `True` gives the plain checkpointed step's memory profile.
        fuse_mlp (`bool` or `"all"`, defaults to `True`): In SwiGLU MLPs (``down_proj(silu(gate_proj(x)) *
            up_proj(x))``, as in Llama, Mistral, Qwen2) whose down projection is a FastLoRA layer, fuse the SwiGLU
            into the down projection while training ([`~peft_fastlora.ops.swiglu_lora_linear`]): backward works
            from ``gate`` and ``up`` instead of keeping ``silu(gate) * up``, one tokens x intermediate tensor less
            per layer (replaces Liger's SwiGLU); where gate and up are also a projection group
            (``group_projections``), the SwiGLU kernels add their LoRA terms too
            ([`~peft_fastlora.ops.grouped_lora_mlp`]). `"all"`: when all three projections are FastLoRA layers with one
            plain adapter and no bias, the whole MLP trains as one op ([`~peft_fastlora.ops.lora_mlp`]) whose LoRA
            terms are summed inside the base matmuls in fp32, so that a LoRA term under half a bf16 ulp of the
            output (early in training, B starting at zero) is not rounded away; on an H100 it runs at the speed of
            `True` with 0.04-0.12 GiB more peak memory (docs/fast-path.md). Other MLPs fall back to `True`. Eager
            blocks only.
        group_projections (`bool`, defaults to `True`): Train the projections that read one input, an attention's
            q/k/v and a gated MLP's gate/up, as one op each ([`~peft_fastlora.ops.lora_linear_group`]) where two or
            more of them are FastLoRA layers with one plain adapter each: the input is read once for all LoRA
            factors in forward and once in backward, the input gradient is summed inside the matmuls instead of by
            autograd, and the low-rank terms go into it in one pass (``projection_group.py``; on an H100 the q/k/v
            group's forward+backward takes 0.89x the separate ops' time at 8,192 tokens). Eager blocks only;
            generation and evaluation keep each layer's own path.
        fused_loss (`bool`, defaults to `True`): Compute the LM head and the cross-entropy of training forwards in
            chunks of rows ([`~peft_fastlora.ops.linear_cross_entropy`]), never the whole fp32 logits. Models whose
            logits are capped or scaled, or that add a router loss, keep their own (noted in the report); naming
            ``"fused_linear_cross_entropy"`` in ``liger`` uses Liger's fused loss instead.
        compile_options (`dict`, *optional*): Keyword arguments for ``torch.compile`` of each block (e.g.
            ``{"backend": "aot_eager"}`` in tests).

    Returns:
        [`FastPathReport`]: What was applied, also logged at INFO level.
    """
    only = None
    if not isinstance(liger, (bool, str)):
        only = _check_kernel_names(liger)
        liger = True
    _check_choice("liger", liger, (True, False, "auto"))
    _check_choice("compile_blocks", compile_blocks, (True, False))
    _check_choice("offload_activations", offload_activations, (True, False))
    _check_choice("recompute_last_block", recompute_last_block, (True, False))
    _check_choice("fuse_mlp", fuse_mlp, (True, False, "all"))
    _check_choice("group_projections", group_projections, (True, False))
    _check_choice("fused_loss", fused_loss, (True, False))
    hf_model = transformers_model(model)
    model_type = str(getattr(hf_model.config, "model_type", "") or type(hf_model).__name__)
    report = FastPathReport(model_type=model_type)
    blocks = decoder_blocks(hf_model)
    compile_now = bool(compile_blocks)
    if compile_now and not blocks:
        raise ValueError(f"compile_blocks=True: found no decoder blocks in {type(hf_model).__name__} "
                         f"(looked for its `_no_split_modules` classes: {hf_model._no_split_modules}).")  # fmt: skip
    mlps = _swiglu_mlps(blocks) if fuse_mlp and not compile_now else []
    if fuse_mlp and compile_now:
        report.notes.append("fused MLP off (compiled blocks: inductor fuses the SwiGLU)")
    if fused_loss and not (only is not None and "fused_linear_cross_entropy" in only):
        report.fused_loss = apply_fused_loss(hf_model)
        if not report.fused_loss:
            report.notes.append(f"fused loss off ({fused_loss_refusal(hf_model)})")
    if liger:
        report.liger_kernels = _apply_liger(hf_model, model_type, strict=liger is True, compiled=compile_now,
                                            notes=report.notes, only=only, swiglu=not mlps,
                                            loss=not report.fused_loss)  # fmt: skip
    if "rms_norm" in report.liger_kernels:
        report.rms_norms = apply_rms_norms(hf_model)
    if mlps and only is not None and "swiglu" in only:
        report.notes.append("Liger's swiglu replaced by the fused MLP (fuse_mlp=False keeps it)")
    for mlp in mlps:
        set_instance_forward(mlp, _lora_mlp_forward if fuse_mlp == "all" else _fused_mlp_forward)
    report.fused_mlps = len(mlps)
    if group_projections and compile_now:
        report.notes.append("projection groups off (compiled blocks)")
    elif group_projections:
        report.projection_groups = group_projections_of(blocks)
    if compile_now:
        report.compiled_blocks = _compile_blocks(blocks, compile_options or {})
    report.last_block_kept, report.offload_activations = apply_checkpoint_policy(
        hf_model, blocks, recompute_last_block=recompute_last_block, offload=offload_activations, notes=report.notes)
    logger.info(report.summary())
    return report


def _check_kernel_names(names) -> frozenset:
    try:
        chosen = frozenset(names)
    except TypeError:
        chosen = None
    if not chosen or any(not isinstance(n, str) or n not in LIGER_KERNELS for n in chosen):
        raise ValueError(f"`liger` must be True, False, 'auto' or a non-empty sequence of kernel names from "
                         f"{list(LIGER_KERNELS)}, got {names!r}.")  # fmt: skip
    return chosen


def _check_choice(name: str, value, allowed: tuple) -> None:
    if not any(value is a or (isinstance(a, str) and value == a) for a in allowed):
        raise ValueError(f"`{name}` must be one of {', '.join(map(repr, allowed))}, got {value!r}.")


def transformers_model(model: nn.Module) -> nn.Module:
    """The transformers model under a `PeftModel` (or ``model`` itself)."""
    get_base = getattr(model, "get_base_model", None)
    hf_model = get_base() if callable(get_base) else model
    if not hasattr(hf_model, "config"):
        raise TypeError(f"expected a transformers model or a PeftModel wrapping one, got "
                        f"{type(model).__name__}.")  # fmt: skip
    return hf_model


def decoder_blocks(hf_model: nn.Module) -> list[nn.Module]:
    """The repeated decoder blocks: instances of the classes the model declares unsplittable (``_no_split_modules``,
    which transformers uses for ``device_map`` and FSDP wrapping), outermost first."""
    names = set(getattr(hf_model, "_no_split_modules", None) or [])
    blocks = [m for m in hf_model.modules() if type(m).__name__ in names]
    return [b for b in blocks if not any(b is not o and _contains(o, b) for o in blocks)]


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


# ---- Liger-Kernel --------------------------------------------------------------------------------------------------


def liger_available() -> bool:
    """Whether Liger-Kernel can be imported."""
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _apply_liger(hf_model, model_type: str, *, strict: bool, compiled: bool, notes: list[str],
                 only: Optional[frozenset] = None, swiglu: bool = True, loss: bool = True) -> list[str]:  # fmt: skip
    def refuse(message: str) -> list[str]:
        if strict:
            raise RuntimeError(message)
        warnings.warn(message + " The fast path continues without Liger-Kernel.", stacklevel=3)
        notes.append("Liger-Kernel not applied")
        return []

    if not liger_available():
        return refuse(f"Liger-Kernel is not installed: {FAST_EXTRA_HINT}.")
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    apply_fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply_fn is None:
        return refuse(f"Liger-Kernel has no kernels for model_type {model_type!r}.")
    kernels = {"fused_linear_cross_entropy": loss, "cross_entropy": False}  # loss: not when ours applies
    # Compiled blocks: inductor fuses these itself, and Liger's SwiGLU kernel does not compile (see module docstring).
    for name in ("rope", "rms_norm", "swiglu", "geglu"):
        kernels[name] = not compiled
    kernels["swiglu"] = kernels["swiglu"] and swiglu  # the fused MLP replaces it
    if only is not None:
        if compiled and only - {"fused_linear_cross_entropy"}:
            notes.append("compiled blocks: Liger's " + ", ".join(sorted(only - {"fused_linear_cross_entropy"}))
                         + " not applied (inductor fuses them)")  # fmt: skip
        kernels = {name: on and name in only for name, on in kernels.items()}
    head = hf_model.get_output_embeddings() if hasattr(hf_model, "get_output_embeddings") else None
    if kernels["fused_linear_cross_entropy"] and head is not None and not plain_head(head):
        # The fused loss reads lm_head.weight directly: a LoRA (or any wrapped) head would lose its adapter.
        kernels["fused_linear_cross_entropy"] = False
        notes.append(f"fused linear cross-entropy off (lm_head is a {type(head).__name__}, not nn.Linear)")
    accepted = inspect.signature(apply_fn).parameters
    kwargs = {k: v for k, v in kernels.items() if k in accepted}
    if not any(kwargs.values()):
        return []  # nothing left for Liger (compiled blocks with the fused loss): leave the model alone
    apply_fn(model=hf_model, **kwargs)
    return [k for k, on in kwargs.items() if on]


# ---- fused SwiGLU MLP ----------------------------------------------------------------------------------------------


def _swiglu_mlps(blocks: list[nn.Module]) -> list[nn.Module]:
    """The blocks' ``mlp`` modules of the form ``down_proj(silu(gate_proj(x)) * up_proj(x))`` whose down projection
    is a FastLoRA layer."""
    from .layer import FastLoraLayer

    found = []
    for block in blocks:
        mlp = getattr(block, "mlp", None)
        if mlp is None or not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            continue
        silu = isinstance(mlp.act_fn, nn.SiLU) or type(mlp.act_fn).__name__ == "SiLUActivation"  # transformers' own
        if silu and isinstance(mlp.down_proj, FastLoraLayer):
            found.append(mlp)
    return found


def _lora_projections(mlp: nn.Module, hidden_states: torch.Tensor) -> Optional[tuple[LoraProjection, ...]]:
    """The MLP's gate, up and down projections for [`lora_mlp`] when each is one FastLoRA op with one plain adapter
    and no bias (and the compute dtype is not fp16, whose overflow guard runs per layer); else None."""
    from .layer import FastLoraLayer

    layers = [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    if not all(isinstance(layer, FastLoraLayer) for layer in layers):
        return None
    projections = plain_lora_projections(layers, hidden_states)
    if projections is None or any(p.bias is not None for p in projections):
        return None
    return tuple(projections) if lora_mlp_fusable(*projections) else None


def _lora_mlp_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """A SwiGLU MLP's forward as one [`lora_mlp`] op when it trains with plain adapters on all three projections;
    otherwise as [`_fused_mlp_forward`]."""
    projections = _lora_projections(self, hidden_states) if torch.is_grad_enabled() else None
    if projections is None:
        return _fused_mlp_forward(self, hidden_states)
    return lora_mlp(hidden_states, *projections)


def _fused_mlp_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """A SwiGLU MLP's forward with the SwiGLU fused into the down projection when that is one FastLoRA op and a
    backward will follow; otherwise (inference, several adapters, dropout, merged) the module's own math. Where gate
    and up are a projection group too, the MLP is one [`grouped_lora_mlp`]: the SwiGLU kernels add gate's and up's
    LoRA terms."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling() and grouped([self.gate_proj, self.up_proj]):
        projections = plain_lora_projections([self.gate_proj, self.up_proj, self.down_proj], hidden_states)
        if projections is not None:
            return grouped_lora_mlp(hidden_states, *projections)
    gate, up = self.gate_proj(hidden_states), self.up_proj(hidden_states)
    args = self.down_proj.single_adapter_args(gate) if torch.is_grad_enabled() else None
    if args is None:
        return self.down_proj(self.act_fn(gate) * up)
    weight, bias, lora_a, lora_b, scaling = args
    return swiglu_lora_linear(gate, up, weight, bias, lora_a, lora_b, scaling)


# ---- regional compilation ------------------------------------------------------------------------------------------


def _class_forward(block: nn.Module):
    """The block class's own forward, and whether transformers wraps it in its checkpointing wrapper (transformers
    releases that checkpoint in ``forward`` rather than in ``__call__``; ``functools.wraps`` keeps the original)."""
    forward = type(block).forward
    if forward.__code__.co_name == "forward_with_checkpointing" and hasattr(forward, "__wrapped__"):
        return forward.__wrapped__, True
    return forward, False


def _compile_blocks(blocks: list[nn.Module], options: dict) -> int:
    limit = 4 * len(blocks) + 8  # train/eval x checkpointed or not, per block, with room for a dynamic-shape retry
    if torch._dynamo.config.recompile_limit < limit:
        torch._dynamo.config.recompile_limit = limit
    compiled = 0
    for block in blocks:
        if _COMPILED_MARK in block.__dict__:
            compiled += 1
            continue
        forward, checkpoints_in_forward = _class_forward(block)
        compiled_forward = torch.compile(forward, **options)
        block.__dict__[_COMPILED_MARK] = forward
        block.forward = MethodType(_block_forward(compiled_forward, checkpoints_in_forward), block)
        compiled += 1
    return compiled


def _block_forward(compiled_forward, checkpoints_in_forward: bool):
    """The instance forward of a compiled block.

    A training step gets no KV cache: nothing reads it, and the cache update indexes by ``layer_idx``, which would make
    dynamo compile the block once per layer. Where transformers checkpoints inside the class forward, the instance
    forward replaces that wrapper, so it checkpoints the same way itself: around the compiled code, never inside it.
    """

    def forward(self, *args, **kwargs):
        if not (self.training and torch.is_grad_enabled()):
            # Generation and evaluation run eagerly: with a KV cache dynamo would specialise on each layer's cache
            # state, and decoding has its own compiled path (peft_fastlora.compile_for_generation).
            return type(self).forward(self, *args, **kwargs)
        for key in ("past_key_values", "cache", "layer_past"):
            if kwargs.get(key) is not None:
                kwargs[key] = None
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        if checkpoints_in_forward and self.gradient_checkpointing:
            return self._gradient_checkpointing_func(functools.partial(compiled_forward, self, **kwargs), *args)
        return compiled_forward(self, *args, **kwargs)

    return forward
