"""Compiled generation: the decode step of a (FastLoRA) model compiled with CUDA graphs, adapters active.

transformers compiles the decode step of ``generate`` on its own only for models its quantizer calls compileable,
which bitsandbytes models are not. [`compile_for_generation`] does the same thing for a FastLoRA model: the prompt
(prefill) runs eagerly, every one-token decode step runs the compiled forward (``mode="reduce-overhead"``: one CUDA
graph replay per step), and the KV cache is static so the step's shapes never change. The FastLoRA layers reach their
Triton kernels through ``torch.ops.peft_fastlora`` custom ops, so the step compiles as one graph.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch import nn

from .fast_path import transformers_model

EAGER_FORWARD = "_fastlora_eager_forward"  # the forward compile_for_generation replaced
# What graphed_generate keeps on the model: the recorded decoder (graphs, KV cache) and the compiled one-token forward.
GRAPHED_DECODER, GRAPHED_COMPILED_STEP = "_fastlora_graphed_decoder", "_fastlora_compiled_decode_step"
GRAPHED_STATE = (GRAPHED_DECODER, GRAPHED_COMPILED_STEP)


def compile_for_generation(
    model: nn.Module, *, mode: Optional[str] = "reduce-overhead", **compile_kwargs: Any
) -> nn.Module:
    """Compiles the decode step of ``model.generate`` (in place) and makes the static KV cache its default.

    Args:
        model (`nn.Module`): A transformers causal LM or a `PeftModel` wrapping one.
        mode (`str`, *optional*, defaults to `"reduce-overhead"`): The ``torch.compile`` mode of the decode step
            (`"reduce-overhead"` replays it as a CUDA graph; `None` with another ``backend`` in tests).
        compile_kwargs: More ``torch.compile`` arguments (default ``fullgraph=True, dynamic=False``).

    Returns:
        `nn.Module`: ``model``, whose ``generate`` now decodes with the compiled step. Greedy outputs equal eager
        generation's; call [`restore_eager_generation`] to undo (before training again, for example).
    """
    hf_model = transformers_model(model)
    if EAGER_FORWARD in hf_model.__dict__:
        return model
    eager = hf_model.forward
    options = {"fullgraph": True, "dynamic": False, **compile_kwargs}
    compiled = torch.compile(eager, mode=mode, **options)
    cudagraphs = mode in ("reduce-overhead", "max-autotune")

    @functools.wraps(eager)
    def forward(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or ids.shape[-1] != 1 or torch.is_grad_enabled():
            return eager(*args, **kwargs)  # the prompt, or a call that trains: eager
        if cudagraphs:
            # Each decode step is a new graph replay: its outputs may overwrite the previous step's.
            torch.compiler.cudagraph_mark_step_begin()
        outputs = compiled(*args, **kwargs)
        if cudagraphs and getattr(outputs, "logits", None) is not None:
            outputs.logits = outputs.logits.clone()  # generate keeps the logits past the next replay
        return outputs

    hf_model.__dict__[EAGER_FORWARD] = eager
    hf_model.forward = forward
    hf_model.generation_config.cache_implementation = "static"
    return model


def restore_eager_generation(model: nn.Module) -> nn.Module:
    """Undoes [`compile_for_generation`]: eager forward, and the default (dynamic) KV cache. Also frees what
    [`graphed_generate`] keeps on the model between calls (its recorded graphs, KV cache and compiled step)."""
    hf_model = transformers_model(model)
    for key in GRAPHED_STATE:
        hf_model.__dict__.pop(key, None)
    eager = hf_model.__dict__.pop(EAGER_FORWARD, None)
    if eager is not None:
        del hf_model.forward
        hf_model.generation_config.cache_implementation = None
    return model
