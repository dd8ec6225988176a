"""graphed_generate: the on-device decode loop gives generate's tokens (greedy), samples from the right distribution,
stops at end-of-sequence like generate, refuses bad input by name, and (GPU) replays its CUDA graph correctly."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

import peft_fastlora
from peft_fastlora.generation import GRAPHED_DECODER
from peft_fastlora.graphed_decode import _picker
from tests.utils import TINY_LLAMA, fast_config, load_quantized


def _quantized(path, device, **kwargs):
    """The tiny Llama in nf4 with fp32 compute: the exact-token comparisons below test the decode loop, and in bf16
    a random model's near-ties (one bf16 step apart) flip on the rounding difference between two KV-cache lengths."""
    return load_quantized(path, dtype=torch.float32, compute_dtype=torch.float32, device=device, **kwargs)


def _trained_looking(model):
    """Non-zero lora_B (a fresh adapter adds nothing) and wider logit margins."""
    with torch.no_grad():
        model.get_base_model().get_output_embeddings().weight.mul_(20)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.1)
    return model.eval()


@pytest.fixture
def fastlora_cpu(tiny_llama_path):
    return _trained_looking(get_peft_model(_quantized(tiny_llama_path, "cpu"), fast_config()))


def _left_padded(rows=3, seq=7, seed=3, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, TINY_LLAMA["vocab_size"], (rows, seq), generator=gen)
    mask = torch.ones_like(ids)
    if rows > 1:  # row 1: three pads on the left
        mask[1, :3] = 0
        ids[1, :3] = 0
    return ids.to(device), mask.to(device)


def _seeded_samples(model, ids, mask, seed, **kwargs):
    """A sampled (temperature 5: far from greedy) graphed_generate after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return peft_fastlora.graphed_generate(model, ids, mask, ignore_eos=True, do_sample=True, temperature=5.0, **kwargs)


def _generate(model, ids, mask, new, **kwargs):
    kwargs = {"do_sample": False, "pad_token_id": 0, "cache_implementation": "static", **kwargs}
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, **kwargs)


def test_greedy_matches_generate_with_left_padding(fastlora_cpu):
    ids, mask = _left_padded()
    expected = _generate(fastlora_cpu, ids, mask, 9, min_new_tokens=9)
    got = peft_fastlora.graphed_generate(fastlora_cpu, ids, mask, max_new_tokens=9, ignore_eos=True)
    assert got.shape == (3, 16)
    assert torch.equal(got, expected)


def test_stops_at_eos_like_generate(fastlora_cpu):
    ids, mask = _left_padded()
    free = peft_fastlora.graphed_generate(fastlora_cpu, ids, mask, max_new_tokens=10, ignore_eos=True)
    eos = int(free[0, ids.shape[1] + 2])  # row 0 meets it at its third new token
    expected = _generate(fastlora_cpu, ids, mask, 10, eos_token_id=eos, pad_token_id=1)
    got = peft_fastlora.graphed_generate(fastlora_cpu, ids, mask, max_new_tokens=10, eos_token_id=eos, pad_token_id=1)
    assert torch.equal(got, expected)
    assert (got[0, ids.shape[1] + 3 :] == 1).all()  # padded after its end-of-sequence token


def test_stops_early_when_every_row_finished(fastlora_cpu):
    ids, mask = _left_padded(rows=1)
    free = peft_fastlora.graphed_generate(fastlora_cpu, ids, mask, max_new_tokens=10, ignore_eos=True)
    eos = int(free[0, ids.shape[1] + 1])
    first = int((free[0, ids.shape[1] :] == eos).nonzero()[0])  # the token may occur before its second place
    got = peft_fastlora.graphed_generate(fastlora_cpu, ids, mask, max_new_tokens=10, eos_token_id=[eos, 127])
    assert got.shape[1] == ids.shape[1] + first + 1
    assert torch.equal(got, free[:, : got.shape[1]])


def test_decoder_is_reused_and_follows_adapter_state(fastlora_cpu):
    ids, mask = _left_padded()
    first = peft_fastlora.graphed_generate(fastlora_cpu, ids, mask, max_new_tokens=5, ignore_eos=True)
    decoder = fastlora_cpu.get_base_model().__dict__[GRAPHED_DECODER]
    again = peft_fastlora.graphed_generate(fastlora_cpu, ids, mask, max_new_tokens=5, ignore_eos=True)
    assert fastlora_cpu.get_base_model().__dict__[GRAPHED_DECODER] is decoder and torch.equal(again, first)
    with fastlora_cpu.disable_adapter():
        expected = _generate(fastlora_cpu, ids, mask, 5, min_new_tokens=5)
        got = peft_fastlora.graphed_generate(fastlora_cpu, ids, mask, max_new_tokens=5, ignore_eos=True)
        assert fastlora_cpu.get_base_model().__dict__[GRAPHED_DECODER] is not decoder  # a new setting: adapters off
    assert torch.equal(got, expected) and not torch.equal(got, first)
    peft_fastlora.restore_eager_generation(fastlora_cpu)  # frees the kept decoder
    assert GRAPHED_DECODER not in fastlora_cpu.get_base_model().__dict__


@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.7, None), (1.3, 3)])
def test_sampling_draws_from_softmax(temperature, top_k):
    logits = torch.randn(1, 6, generator=torch.Generator().manual_seed(5)) * 2
    draws = _picker(True, temperature, top_k)(logits.expand(40_000, 6).clone())
    freq = torch.bincount(draws, minlength=6).double() / draws.numel()
    scaled = logits[0].double() / temperature
    if top_k is not None:
        scaled[scaled < scaled.topk(top_k).values[-1]] = float("-inf")
    expected = torch.softmax(scaled, dim=0)
    assert torch.allclose(freq, expected, atol=0.012), (freq, expected)
    if top_k is not None:
        assert (freq[expected == 0] == 0).all()


def test_sampling_top_k_1_is_greedy_and_seeded_runs_repeat(fastlora_cpu):
    ids, mask = _left_padded()
    greedy = peft_fastlora.graphed_generate(fastlora_cpu, ids, mask, max_new_tokens=6, ignore_eos=True)
    top1 = peft_fastlora.graphed_generate(fastlora_cpu, ids, mask, max_new_tokens=6, ignore_eos=True, do_sample=True,
                                          top_k=1)  # fmt: skip
    assert torch.equal(top1, greedy)
    first, second = (_seeded_samples(fastlora_cpu, ids, mask, 11, max_new_tokens=6) for _ in range(2))
    assert torch.equal(first, second) and not torch.equal(first, greedy)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=4, steps_per_graph=0), "steps_per_graph"),
        (dict(max_new_tokens=4, temperature=0.0, do_sample=True), "temperature"),
        (dict(max_new_tokens=4, top_k=0), "top_k"),
        (dict(max_new_tokens=4, cuda_graphs=True), "cuda_graphs"),
    ],
)
def test_bad_arguments_are_named(fastlora_cpu, kwargs, match):
    ids, mask = _left_padded()
    with pytest.raises(ValueError, match=match):
        peft_fastlora.graphed_generate(fastlora_cpu, ids, mask, **kwargs)


def test_right_padding_and_empty_rows_are_refused(fastlora_cpu):
    ids, mask = _left_padded()
    with pytest.raises(ValueError, match="left padding"):
        peft_fastlora.graphed_generate(fastlora_cpu, ids, mask.flip(1), max_new_tokens=3)
    mask[2] = 0
    with pytest.raises(ValueError, match="without any token"):
        peft_fastlora.graphed_generate(fastlora_cpu, ids, mask, max_new_tokens=3)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        peft_fastlora.graphed_generate(fastlora_cpu, ids, mask[:, 1:], max_new_tokens=3)


def test_other_attention_implementations_are_refused(fastlora_cpu):
    ids, mask = _left_padded()
    config = fastlora_cpu.get_base_model().config
    saved, config._attn_implementation = config._attn_implementation, "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
            peft_fastlora.graphed_generate(fastlora_cpu, ids, mask, max_new_tokens=3)
    finally:
        config._attn_implementation = saved


def test_eager_attention_gets_an_additive_mask(tiny_llama_path):
    model = _quantized(tiny_llama_path, "cpu")
    model.set_attn_implementation("eager")
    model = _trained_looking(get_peft_model(model, fast_config()))
    ids, mask = _left_padded()
    expected = _generate(model, ids, mask, 6, min_new_tokens=6)
    assert torch.equal(peft_fastlora.graphed_generate(model, ids, mask, max_new_tokens=6, ignore_eos=True), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["fastlora", "lora"])
def test_gpu_graph_replays_match_generate(tiny_llama_path, method):
    """Recorded steps (4 per graph, 13 tokens: the last replay runs past the end) give generate's tokens; a second call
    replays the same graph; an in-place change of the adapter (as an optimizer step makes) reaches the replay."""
    config = fast_config() if method == "fastlora" else LoraConfig(r=8, target_modules="all-linear")
    model = _trained_looking(get_peft_model(_quantized(tiny_llama_path, "cuda"), config))
    ids, mask = _left_padded(device="cuda")
    run = dict(max_new_tokens=13, ignore_eos=True, steps_per_graph=4)
    got = peft_fastlora.graphed_generate(model, ids, mask, **run)
    assert torch.equal(got, _generate(model, ids, mask, 13, min_new_tokens=13))
    decoder = model.get_base_model().__dict__[GRAPHED_DECODER]
    assert decoder.graph is not None and decoder.prefill_graph is not None
    assert torch.equal(peft_fastlora.graphed_generate(model, ids, mask, **run), got)
    again = model.get_base_model().__dict__[GRAPHED_DECODER]
    assert again.graph is decoder.graph and again.prefill_graph is decoder.prefill_graph
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(-3)
    changed = peft_fastlora.graphed_generate(model, ids, mask, **run)
    assert model.get_base_model().__dict__[GRAPHED_DECODER].graph is decoder.graph
    assert torch.equal(changed, _generate(model, ids, mask, 13, min_new_tokens=13))
    assert not torch.equal(changed, got)


@pytest.mark.gpu
def test_gpu_eos_and_sampling_in_graphs(tiny_llama_path):
    model = _trained_looking(get_peft_model(_quantized(tiny_llama_path, "cuda"), fast_config()))
    ids, mask = _left_padded(device="cuda")
    free = peft_fastlora.graphed_generate(model, ids, mask, max_new_tokens=12, ignore_eos=True, steps_per_graph=3)
    eos = int(free[0, ids.shape[1] + 4])
    expected = _generate(model, ids, mask, 12, eos_token_id=eos, pad_token_id=1)
    got = peft_fastlora.graphed_generate(model, ids, mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=1,
                                         steps_per_graph=3)  # fmt: skip
    assert torch.equal(got, expected)
    first, second = (_seeded_samples(model, ids, mask, 4, max_new_tokens=12, steps_per_graph=3) for _ in range(2))
    assert torch.equal(first, second) and not torch.equal(first, free)


@pytest.mark.gpu
def test_gpu_after_compile_for_generation(tiny_llama_path):
    """A model whose generate was compiled still records: graphed_generate takes the eager forward it keeps."""
    model = _trained_looking(get_peft_model(_quantized(tiny_llama_path, "cuda"), fast_config()))
    ids, mask = _left_padded(device="cuda")
    expected = peft_fastlora.graphed_generate(model, ids, mask, max_new_tokens=8, ignore_eos=True)
    peft_fastlora.compile_for_generation(model)
    model.get_base_model().__dict__.pop(GRAPHED_DECODER)
    assert torch.equal(peft_fastlora.graphed_generate(model, ids, mask, max_new_tokens=8, ignore_eos=True), expected)


@pytest.mark.gpu
def test_gpu_compiled_step_matches_eager_step(tiny_llama_path):
    """compile_step records the Inductor-compiled one-token forward: same greedy tokens as the eager step's graph
    (fp32: Inductor's fused norms round differently from eager in bf16), and a second call replays it."""
    model = _trained_looking(get_peft_model(_quantized(tiny_llama_path, "cuda"), fast_config()))
    ids, mask = _left_padded(device="cuda")
    run = dict(max_new_tokens=11, ignore_eos=True, steps_per_graph=4)
    expected = peft_fastlora.graphed_generate(model, ids, mask, **run)
    got = peft_fastlora.graphed_generate(model, ids, mask, compile_step=True, **run)
    assert torch.equal(got, expected)
    graph = model.get_base_model().__dict__[GRAPHED_DECODER].graph
    assert torch.equal(peft_fastlora.graphed_generate(model, ids, mask, compile_step=True, **run), expected)
    assert model.get_base_model().__dict__[GRAPHED_DECODER].graph is graph
