"""The fast path's projection groups: the FastLoRA projections of one module that read one input (an attention module's
q/k/v, a gated MLP's gate/up), trained through [`~peft_fastlora.ops.lora_linear_group`] (one read of the input per pass,
the input gradient summed inside the matmuls; see ``ops/lora_group.py``).

The module's own forward is left alone (every architecture writes its own): each projection gets an instance forward
that goes through its module's [`ProjectionGroup`]. The first projection called on an input computes every member's
output in one op and returns its own; the others, called next on the same tensor (unchanged since), take theirs. That
holds for the attention modules of transformers' decoders (``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` on one
``hidden_states``) and their gated MLPs (``gate_proj(x)``, ``up_proj(x)``). The fast path's fused MLP
(``fuse_mlp=True``) runs a gate/up group itself ([`grouped`] says whether there is one), through
``ops.grouped_lora_mlp``, whose SwiGLU kernels add the group's LoRA terms; ``fuse_mlp="all"`` has its own op. A
module that does otherwise (an output left untaken when the next input arrives) would waste the work: its group then
turns itself off, with one warning, and its projections run alone.

Only training forwards group (grad enabled, eager: ``torch.compile`` traces the separate ops, which it compiles without
graph breaks); generation and evaluation keep each layer's own path (the small-M decode kernel).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
from torch import nn

from ._forward import set_instance_forward
from .ops import LoraProjection, lora_linear_group

# Projections that read one input, by the names transformers' decoders give them, in the order they are called.
SHARED_INPUT_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_GROUP = "_fastlora_projection_group"


class ProjectionGroup:
    """The FastLoRA projections of one module that read one input (see the module docstring).

    Args:
        layers (`list[FastLoraLayer]`): The members, at least two, each with one ``in_features``.
        names (`list[str]`): Their attribute names in the owning module, for the warning.
        owner (`str`): The owning module's class name, for the warning.
    """

    def __init__(self, layers: list[nn.Module], names: list[str], owner: str):
        self.layers = layers
        self.names = names
        self.owner = owner
        self.enabled = True
        self._input: Optional[torch.Tensor] = None
        self._version = -1
        self._pending: dict[int, torch.Tensor] = {}

    def forward(self, index: int, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Member ``index``'s output for ``x``: taken from the last group call on ``x``, or made with its fellows'."""
        layer = self.layers[index]
        if args or kwargs or not self.enabled or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return type(layer).forward(layer, x, *args, **kwargs)
        if self._pending:
            out = self._pending.pop(index, None)
            if out is not None and x is self._input and x._version == self._version:
                if not self._pending:
                    self._input = None
                return out
            self._turn_off()  # a member called on another input while outputs were left untaken
            return type(layer).forward(layer, x)
        projections = plain_lora_projections(self.layers, x)
        if projections is None:
            return type(layer).forward(layer, x)
        outs = lora_linear_group(x, projections)
        self._pending = {i: out for i, out in enumerate(outs) if i != index}
        self._input, self._version = x, x._version
        return outs[index]

    def _turn_off(self) -> None:
        self.enabled = False
        self._pending, self._input = {}, None
        warnings.warn(f"FastLoRA fast path: {self.owner} does not call {', '.join(self.names)} on one input one "
                      f"after the other; its projections now run as separate ops.", stacklevel=4)  # fmt: skip


def plain_lora_projections(layers: list[nn.Module], x: torch.Tensor) -> Optional[list[LoraProjection]]:
    """FastLoRA ``layers`` as [`LoraProjection`]s (biases included) when each one's forward on ``x`` would be one
    plain-adapter op (``single_adapter_args``) and the compute dtype is not fp16, whose overflow guard runs per layer;
    else None. What the fused ops of the fast path (projection groups, the whole LoRA MLP) take."""
    device_type = x.device.type
    autocast = torch.is_autocast_enabled(device_type)
    if (torch.get_autocast_dtype(device_type) if autocast else x.dtype) == torch.float16:
        return None
    projections = []
    for layer in layers:
        args = layer.single_adapter_args(x)
        if args is None:
            return None
        weight, bias, lora_a, lora_b, scaling = args
        projections.append(LoraProjection(weight, lora_a, lora_b, scaling, bias))
    return projections


def grouped(layers: list[nn.Module]) -> bool:
    """Whether ``layers`` are, in order, the members of one projection group that has not turned itself off (the fast
    path's SwiGLU MLP then runs gate and up through the group's op itself: ``ops.grouped_lora_mlp``)."""
    entry = layers[0].__dict__.get(_GROUP)
    if entry is None or not entry[0].enabled:
        return False
    members = entry[0].layers
    return len(members) == len(layers) and all(a is b for a, b in zip(members, layers))


def _member_forward(layer: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    group, index = layer.__dict__[_GROUP]
    return group.forward(index, x, *args, **kwargs)


def group_projections(blocks: list[nn.Module]) -> int:
    """Gives each module inside ``blocks`` whose q/k/v (or gate/up) projections, two or more, are FastLoRA layers of
    one ``in_features`` a [`ProjectionGroup`]; returns how many groups there are (already made ones count)."""
    from .layer import FastLoraLayer

    grouped = 0
    for block in blocks:
        for module, members in ((m, n) for m in block.modules() for n in SHARED_INPUT_PROJECTIONS):
            names = [n for n in members if isinstance(getattr(module, n, None), FastLoraLayer)]
            if len(names) < 2:
                continue
            layers = [getattr(module, n) for n in names]
            if _GROUP in layers[0].__dict__:
                grouped += 1
                continue
            if len({layer.in_features for layer in layers}) != 1:
                continue
            group = ProjectionGroup(layers, names, type(module).__name__)
            for index, layer in enumerate(layers):
                layer.__dict__[_GROUP] = (group, index)
                set_instance_forward(layer, _member_forward)
            grouped += 1
    return grouped
