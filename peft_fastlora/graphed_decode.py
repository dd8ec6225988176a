"""Generation as replays of one CUDA graph that holds several decode steps: no Python, no launch and no host sync
between the tokens of a graph.

A compiled decode step inside ``model.generate`` still pays ``generate``'s own loop on the host for every token
(logits processors, stopping criteria, cache bookkeeping, the compiled call's guards and input copies); at batch 1
that host work took longer than the GPU's work for the token. [`graphed_generate`] keeps the whole decode loop on
the GPU: the next token, its position, its attention-mask row and the KV-cache write are computed from device
tensors, so ``steps_per_graph`` consecutive steps are recorded once (the model runs eagerly while recording, or
compiled with ``compile_step``) and replayed; the host only checks for end-of-sequence between replays. The prompt's
forward is recorded too, per prompt shape (its first run is eager).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

from ._cuda_graphs import model_fingerprint, warm_up_and_record
from .fast_path import transformers_model
from .generation import EAGER_FORWARD, GRAPHED_COMPILED_STEP, GRAPHED_DECODER


@dataclass
class _Decoder:
    """Static buffers, KV cache and (on CUDA) the recorded graph of one (batch, prompt, length, sampling) setting."""

    key: tuple
    cache: object
    tokens: torch.Tensor  # (batch, total): the prompt, then the generated tokens
    step: torch.Tensor  # (1, 1): the index in ``tokens`` of the token the next decode step reads
    pads: torch.Tensor  # (batch, 1): left-padding per row; a token's position is its index minus this
    pad_mask: torch.Tensor  # (batch, max_len): False at padding; the causal part comes from ``step``
    done: torch.Tensor  # (batch,): rows that produced an end-of-sequence token
    stop_ids: Optional[torch.Tensor]
    prefill_graph: Optional[torch.cuda.CUDAGraph] = None  # the prompt's forward and first token
    graph: Optional[torch.cuda.CUDAGraph] = None  # ``steps_per_graph`` decode steps


def graphed_generate(
    model: nn.Module,
    input_ids: torch.LongTensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    eos_token_id: Optional[Union[int, list[int]]] = None,
    pad_token_id: Optional[int] = None,
    ignore_eos: bool = False,
    steps_per_graph: int = 16,
    cuda_graphs: Optional[bool] = None,
    compile_step: bool = False,
) -> torch.LongTensor:
    """Generates with the adapters active, replaying ``steps_per_graph`` decode steps as one CUDA graph.

    Works on any transformers causal LM whose attention layers use a full (non-sliding) static KV cache and the
    ``"sdpa"`` or ``"eager"`` attention implementation: FastLoRA, PEFT LoRA, bitsandbytes or unquantized. Greedy
    tokens equal ``model.generate(..., do_sample=False, cache_implementation="static")``'s. The first call of each
    (batch, prompt length, ``max_new_tokens``, sampling) setting records the graph; later calls replay it, until a
    parameter of the model is replaced (e.g. by merging an adapter), which records it again. The recorded graphs and
    KV cache of the last setting stay on the model; [`restore_eager_generation`] frees them.

    Args:
        model (`nn.Module`): A transformers causal LM or a `PeftModel` wrapping one, on the device of ``input_ids``.
        input_ids (`torch.LongTensor` of shape `(batch, prompt_len)`): The prompts, left-padded when their lengths
            differ (``tokenizer.padding_side = "left"``).
        attention_mask (`torch.Tensor` of shape `(batch, prompt_len)`, *optional*): 1 for tokens, 0 for left padding.
        max_new_tokens (`int`): How many tokens to generate at most.
        do_sample (`bool`, *optional*, defaults to `False`): Sample (Gumbel-max over ``logits / temperature``)
            instead of taking the most likely token.
        temperature (`float`, *optional*, defaults to 1.0): The sampling temperature (> 0).
        top_k (`int`, *optional*): Sample among the ``top_k`` most likely tokens only.
        eos_token_id (`int` or `list[int]`, *optional*): The end-of-sequence token(s); defaults to the model's
            generation config. A row that produced one is padded from then on; generation stops when all rows have.
        pad_token_id (`int`, *optional*): Fills finished rows; defaults to the generation config's pad token, else
            the first end-of-sequence token, else 0.
        ignore_eos (`bool`, *optional*, defaults to `False`): Always generate ``max_new_tokens`` (benchmarks).
        steps_per_graph (`int`, *optional*, defaults to 16): Decode steps per graph replay; the host checks for
            end-of-sequence once per replay.
        cuda_graphs (`bool`, *optional*): Record and replay CUDA graphs; defaults to `True` on CUDA. With `False` the
            same decode loop runs eagerly (on any device).
        compile_step (`bool`, *optional*, defaults to `False`): Compile the one-token forward with ``torch.compile``
            (Inductor fuses the norms, the rotary embedding and the elementwise operations
            between the linear layers) before recording it. The first call per batch size compiles (tens of seconds
            for a Llama-3-8B-sized model); the prompt's forward is not compiled.

    Returns:
        `torch.LongTensor` of shape `(batch, prompt_len + n)`: the prompts and their continuations, ``n <=
        max_new_tokens``, as ``generate`` returns them.
    """
    hf_model = transformers_model(model)
    _check_arguments(hf_model, input_ids, attention_mask, max_new_tokens, temperature, top_k, steps_per_graph)
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    _check_left_padding(mask)
    stop_ids = None if ignore_eos else _ids(eos_token_id, hf_model.generation_config.eos_token_id)
    if pad_token_id is None:
        pad_token_id = hf_model.generation_config.pad_token_id
    if pad_token_id is None:
        pad_token_id = stop_ids[0] if stop_ids else 0
    use_graphs = input_ids.is_cuda if cuda_graphs is None else cuda_graphs
    if use_graphs and not input_ids.is_cuda:
        raise ValueError(f"cuda_graphs=True needs CUDA inputs, got input_ids on {input_ids.device}; pass "
                         f"cuda_graphs=False (or None) to decode eagerly.")  # fmt: skip
    pick = _picker(do_sample, temperature, top_k)
    batch, prompt_len = input_ids.shape
    max_len = prompt_len + max_new_tokens + steps_per_graph  # replays may run past the last token kept
    key = (batch, prompt_len, max_len, steps_per_graph, do_sample, temperature, top_k, stop_ids, pad_token_id,
           input_ids.device, use_graphs, compile_step, model_fingerprint(hf_model))  # fmt: skip
    call = _model_call(hf_model, compile_step)
    with torch.inference_mode():
        decoder = hf_model.__dict__.get(GRAPHED_DECODER)
        if decoder is None or decoder.key != key:
            hf_model.__dict__.pop(GRAPHED_DECODER, None)  # one setting kept: its KV cache can be large
            decoder = _new_decoder(hf_model, key, batch, max_len, input_ids.device, stop_ids)
        _load_prompt(decoder, input_ids, mask, pad_token_id)
        prefill = functools.partial(_prefill, decoder, call, pick, prompt_len, pad_token_id)
        steps = functools.partial(_steps, decoder, call, pick, pad_token_id)
        if decoder.prefill_graph is not None:
            decoder.prefill_graph.replay()
        elif use_graphs:  # the prompt's first run is the warm-up of its recording
            decoder.prefill_graph = warm_up_and_record(prefill, prefill)
        else:
            prefill()
        done_steps, wanted = 1, max_new_tokens
        while done_steps < wanted and not (stop_ids and bool(decoder.done.all())):
            if decoder.graph is not None:
                decoder.graph.replay()
                done_steps += steps_per_graph
            elif use_graphs:  # one real step warms up the recording (Triton, cuBLAS, Inductor); then record
                pool = decoder.prefill_graph.pool()  # replayed one after the other: they can share memory
                decoder.graph = warm_up_and_record(lambda: steps(1), lambda: steps(steps_per_graph), pool)
                done_steps += 1
            else:
                steps(1)
                done_steps += 1
        hf_model.__dict__[GRAPHED_DECODER] = decoder
        out = decoder.tokens[:, : prompt_len + min(done_steps, wanted)].clone()
    return _trim_finished(out, prompt_len, decoder.stop_ids)


def _check_arguments(hf_model, input_ids, attention_mask, max_new_tokens, temperature, top_k, steps_per_graph):
    if not (isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and not input_ids.is_floating_point()):
        raise ValueError(f"input_ids must be an integer tensor of shape (batch, prompt_len), got "
                         f"{getattr(input_ids, 'shape', type(input_ids))}.")  # fmt: skip
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids has an empty prompt (shape[1] == 0); give every row at least one token.")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                         f"{tuple(input_ids.shape)}; they must match.")  # fmt: skip
    for name, value in (("max_new_tokens", max_new_tokens), ("steps_per_graph", steps_per_graph)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}; use do_sample=False for greedy decoding.")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or a positive int, got {top_k!r}.")
    attn = getattr(hf_model.config, "_attn_implementation", None)
    if attn not in ("sdpa", "eager"):
        raise ValueError(f"graphed_generate builds its own attention masks for the 'sdpa' and 'eager' attention "
                         f"implementations; the model uses {attn!r}. Load it with attn_implementation='sdpa', or "
                         f"use model.generate (peft_fastlora.compile_for_generation).")  # fmt: skip


def _check_left_padding(mask: torch.Tensor) -> None:
    if not bool(mask.any(dim=1).all()):
        raise ValueError("attention_mask has a row without any token (all zeros); drop that row.")
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError("attention_mask pads on the right; graphed_generate needs left padding "
                         "(tokenizer.padding_side = 'left').")  # fmt: skip


def _ids(given, default) -> Optional[tuple[int, ...]]:
    ids = default if given is None else given
    if ids is None:
        return None
    ids = (ids,) if isinstance(ids, int) else tuple(int(i) for i in ids)
    return ids or None


def _model_call(hf_model: nn.Module, compile_step: bool) -> Callable:
    """``call(ids, visible, positions, cache) -> last logits``: ``visible`` is a bool (batch, 1, q, kv) mask, handed
    on as the attention implementation takes a ready 4-D mask (bool for sdpa, additive for eager: transformers then
    builds none of its own, and its mask code reads the padding on the host). The cache argument is
    ``past_key_values`` in transformers up to 5.2x and ``cache`` later. With ``compile_step`` one-token calls run
    the compiled forward (kept on the model: compiled once per batch size). Not ``fullgraph``: a graph break (Liger's
    RoPE is excluded from compilation) costs host time only, and the recording replays both sides of it."""
    params = inspect.signature(hf_model.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    additive = hf_model.config._attn_implementation == "eager"
    dtype = hf_model.dtype
    # After compile_for_generation the model's forward runs one-token calls compiled with their own CUDA graphs,
    # which cannot be recorded inside ours: take the eager forward it keeps.
    eager = hf_model.__dict__.get(EAGER_FORWARD, hf_model)
    compiled = None
    if compile_step:
        compiled = hf_model.__dict__.get(GRAPHED_COMPILED_STEP)
        if compiled is None:
            compiled = hf_model.__dict__[GRAPHED_COMPILED_STEP] = torch.compile(eager, dynamic=False)

    def call(ids, visible, positions, cache):
        mask = visible
        if additive:
            mask = torch.zeros((), dtype=dtype, device=visible.device).masked_fill(~visible, torch.finfo(dtype).min)
        forward = compiled if compiled is not None and ids.shape[1] == 1 else eager
        out = forward(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                      **{cache_arg: cache})  # fmt: skip
        return out.logits[:, -1]

    return call


def _new_decoder(hf_model, key, batch, max_len, device, stop_ids) -> _Decoder:
    from transformers import StaticCache

    cache = StaticCache(config=hf_model.config, max_cache_len=max_len)
    if any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", [])):
        raise ValueError("graphed_generate supports full-attention KV caches; this model has sliding-window "
                         "layers. Use model.generate (peft_fastlora.compile_for_generation).")  # fmt: skip
    long = dict(dtype=torch.long, device=device)
    return _Decoder(
        key=key,
        cache=cache,
        tokens=torch.zeros(batch, max_len + 1, **long),
        step=torch.zeros(1, 1, **long),
        pads=torch.zeros(batch, 1, **long),
        pad_mask=torch.ones(batch, max_len, dtype=torch.bool, device=device),
        done=torch.zeros(batch, dtype=torch.bool, device=device),
        stop_ids=None if stop_ids is None else torch.tensor(stop_ids, **long),
    )


def _load_prompt(decoder: _Decoder, input_ids, mask, pad_token_id: int) -> None:
    """Copies the prompt into the static buffers (the recorded graphs read them by address) and empties the cache."""
    prompt_len = input_ids.shape[1]
    decoder.cache.reset()
    decoder.tokens.fill_(pad_token_id)
    decoder.tokens[:, :prompt_len] = input_ids
    decoder.pad_mask.fill_(True)
    decoder.pad_mask[:, :prompt_len] = mask
    decoder.done.fill_(False)


def _prefill(decoder: _Decoder, call, pick, prompt_len: int, pad_token_id: int) -> None:
    """The prompt's forward and first token, from the static buffers only (so it can be recorded too)."""
    mask = decoder.pad_mask[:, :prompt_len]
    decoder.step.fill_(prompt_len - 1)
    decoder.pads.copy_(prompt_len - mask.sum(dim=1, keepdim=True))
    positions = (mask.long().cumsum(dim=1) - 1).clamp_min(0)
    keys = torch.arange(decoder.pad_mask.shape[1], device=mask.device)
    causal = keys[None, :] <= torch.arange(prompt_len, device=mask.device)[:, None]
    visible = (causal[None] & decoder.pad_mask[:, None, :])[:, None]
    logits = call(decoder.tokens[:, :prompt_len], visible, positions, decoder.cache)
    _store_next(decoder, pick(logits), pad_token_id)


def _steps(decoder: _Decoder, call, pick, pad_token_id: int, count: int) -> None:
    """``count`` decode steps computed from device tensors only (no host sync: they can be recorded as a graph)."""
    keys = torch.arange(decoder.pad_mask.shape[1], device=decoder.step.device)[None, :]
    rows = decoder.tokens.shape[0]
    for _ in range(count):
        ids = decoder.tokens.gather(1, decoder.step.expand(rows, 1))
        visible = ((keys <= decoder.step) & decoder.pad_mask)[:, None, None, :]
        logits = call(ids, visible, decoder.step - decoder.pads, decoder.cache)
        _store_next(decoder, pick(logits), pad_token_id)


def _store_next(decoder: _Decoder, next_ids: torch.Tensor, pad_token_id: int) -> None:
    """Writes the next token after ``step`` (pad for finished rows), marks finished rows and advances ``step``."""
    if decoder.stop_ids is not None:
        next_ids = torch.where(decoder.done, pad_token_id, next_ids)
        decoder.done |= torch.isin(next_ids, decoder.stop_ids)
    rows = decoder.tokens.shape[0]
    decoder.step += 1
    decoder.tokens.scatter_(1, decoder.step.expand(rows, 1), next_ids[:, None])


def _picker(do_sample: bool, temperature: float, top_k: Optional[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    """logits (batch, vocab) -> token ids (batch,). Sampling uses the Gumbel-max trick: ``argmax(logits / T + G)``
    with standard Gumbel noise ``G`` is a draw from ``softmax(logits / T)``, with no host sync (``multinomial``
    would need none either, but its CUDA kernel cannot be recorded in a graph on every torch version)."""

    def pick(logits: torch.Tensor) -> torch.Tensor:
        if not do_sample:
            return logits.argmax(dim=-1)
        scores = logits.float() / temperature
        if top_k is not None and top_k < scores.shape[-1]:
            kth = scores.topk(top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        gumbel = -torch.empty_like(scores).uniform_().log().neg_().log()  # -log(-log(U)), U in [0, 1)
        return (scores + gumbel).argmax(dim=-1)

    return pick


def _trim_finished(out: torch.Tensor, prompt_len: int, stop_ids: Optional[torch.Tensor]) -> torch.Tensor:
    """Drops the trailing columns in which every row had already finished, as ``generate`` stops there."""
    if stop_ids is None or out.shape[1] == prompt_len:
        return out
    new = out[:, prompt_len:]
    stop = torch.isin(new, stop_ids)
    finished_before = (stop.long().cumsum(dim=1) - stop.long()) > 0  # a stop token earlier in the row
    live = (~finished_before).any(dim=0)
    keep = int(live.nonzero().max()) + 1 if bool(live.any()) else 0
    return out[:, : prompt_len + keep]
