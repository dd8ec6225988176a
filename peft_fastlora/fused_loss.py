"""The fast path's fused loss: a causal LM's training forward that hands its LM head and loss to
[`~peft_fastlora.ops.linear_cross_entropy`], so the ``tokens x vocab`` logits are never materialised.

[`apply_fused_loss`] replaces the forward of one transformers model instance. The replacement runs the model's
backbone, then the fused head + loss, when a loss will be differentiated: ``labels`` given, grad enabled, training
mode, an LM head that is a plain ``nn.Linear`` at the time of the call (a PEFT-wrapped head keeps its adapter by taking
the model's own forward). Everything else (evaluation, generation, no labels, positional arguments beyond
``input_ids``) runs the model's own forward. The returned output has ``loss`` and no ``logits``, as Liger-Kernel's and
TRL's fused heads do.

Models whose logits are not ``lm_head(hidden)`` (soft-capped or scaled logits: Gemma 2/3, Cohere, Granite, ...) or
that add a router loss (mixture-of-experts) are left alone, with a note saying why.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ._forward import set_instance_forward
from .ops import linear_cross_entropy

_FUSED_LOSS_MARK = "_fastlora_fused_loss"
# Config fields that change the logits after the LM head or add to the loss: the fused loss would get them wrong.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier",
                     "lm_head_multiplier", "output_router_logits", "num_experts", "num_local_experts")  # fmt: skip


def fused_loss_refusal(hf_model: nn.Module) -> Optional[str]:
    """Why the fused loss cannot replace ``hf_model``'s head and loss, or None if it can."""
    config = getattr(hf_model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = [name for name in _LOGIT_TRANSFORMS if getattr(text_config, name, None) not in (None, False, 0, 1, 1.0)]
    if found:
        return f"the model's config sets {', '.join(found)} (its logits or loss are not lm_head + cross-entropy)"
    prefix = getattr(hf_model, "base_model_prefix", "")
    if not prefix or not isinstance(getattr(hf_model, prefix, None), nn.Module):
        return f"{type(hf_model).__name__} has no backbone under its base_model_prefix {prefix!r}"
    head = hf_model.get_output_embeddings() if hasattr(hf_model, "get_output_embeddings") else None
    if not plain_head(head):
        return f"{type(hf_model).__name__} has no nn.Linear output embedding (found {type(head).__name__})"
    return None


def apply_fused_loss(hf_model: nn.Module) -> bool:
    """Replaces ``hf_model``'s forward (this instance only) with the fused-loss forward; idempotent. Returns whether
    it applies (see [`fused_loss_refusal`])."""
    if fused_loss_refusal(hf_model) is not None:
        return False
    if _FUSED_LOSS_MARK not in hf_model.__dict__:
        # The forward it wraps (the class's, or one another library set on the instance) is kept on the instance, so
        # deepcopy and pickle rebind it to the copy along with the wrapper.
        hf_model.__dict__[_FUSED_LOSS_MARK] = hf_model.forward
        set_instance_forward(hf_model, _fused_forward)
    return True


def plain_head(head: Optional[nn.Module]) -> bool:
    """Whether a fused loss may read ``head.weight`` (and ``head.bias``) as the LM head."""
    # Only an unwrapped nn.Linear is read directly: a PEFT layer on lm_head holds the base layer (and keeps its adapter
    # through the model's forward), a quantized head (a subclass) stores its weight packed.
    return type(head) is nn.Linear


def _fused_forward(model: nn.Module, *args, **kwargs):
    original = model.__dict__[_FUSED_LOSS_MARK]
    labels = kwargs.get("labels")
    if args and "input_ids" not in kwargs and len(args) == 1:
        kwargs["input_ids"], args = args[0], ()
    head = model.get_output_embeddings()
    # TRL's own fused head (`fused_lm_head=True`, when it wrapped this forward) and tuple outputs take the original.
    if (labels is None or args or not (model.training and torch.is_grad_enabled()) or not plain_head(head)
            or kwargs.get("return_dict") is False or "fused_lm_head" in kwargs):  # fmt: skip
        return original(*args, **kwargs)
    labels, shift_labels = kwargs.pop("labels"), kwargs.pop("shift_labels", None)
    num_items, ignore_index = kwargs.pop("num_items_in_batch", None), kwargs.pop("ignore_index", -100)
    kwargs.pop("logits_to_keep", None)
    kwargs["use_cache"] = False
    outputs = getattr(model, model.base_model_prefix)(**kwargs)
    hidden = outputs[0].to(head.weight.device)  # a model split over devices (device_map) ends its backbone elsewhere
    if shift_labels is None:  # tokens < n predict token n, as transformers' ForCausalLMLoss shifts them
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = linear_cross_entropy(hidden, head.weight, shift_labels, head.bias, ignore_index=ignore_index,
                                num_items_in_batch=num_items)  # fmt: skip
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=getattr(outputs, "hidden_states", None),
                                  attentions=getattr(outputs, "attentions", None))  # fmt: skip
