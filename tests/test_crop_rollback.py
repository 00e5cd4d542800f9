"""Past recording (hfkv.layer.rollback): after ``activate_past_recording()`` a compressing cache crops exactly, and
assisted decoding gives greedy decoding's tokens. References: the same cache fed only the kept tokens, and greedy
single-token steps, both bit for bit where the inputs are the same tensors."""

from __future__ import annotations

import pytest
import torch

import hfkv
from hfkv.attention.interface import hfkv_attention
from tests.models import tiny_model

PROMPT, CHUNK, KEEP = 20, 5, 2
PRESETS = {
    "hfkv": dict(budget=16, window=4),  # scored tiers and a budget
    "quant": dict(window=4),  # stored from the first token, quantized as tokens leave the window
    "evict": dict(budget=16, window=4),
}
# The first forward of assisted decoding carries the prompt (3 tokens) and 3 candidates: within the window, or (hfkv)
# the dense phase's budget.
GENERATE = {"hfkv": dict(budget=16, window=4), "quant": dict(window=8), "evict": dict(budget=16, window=6)}


def _inputs(model, seed: int = 0):
    """Keys, values and queries of the prompt and of a chunk after it, for layer 0 (driven by hand)."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    kv, hq, d = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads

    def part(n):
        return (
            torch.randn(1, kv, n, d, generator=g),
            torch.randn(1, kv, n, d, generator=g),
            torch.randn(1, hq, n, d, generator=g),
        )

    return part(PROMPT), part(CHUNK), d**-0.5


def _mask(start: int, q: int) -> torch.Tensor:
    """SDPA's boolean causal mask of a chunk of ``q`` queries after ``start`` tokens."""
    pos = torch.arange(start + q)
    return (pos[None, :] <= pos[start:, None])[None, None]


def _forward(cache, module, k, v, q, scaling, masked: bool) -> torch.Tensor:
    mask = _mask(cache.get_seq_length(), k.shape[2]) if masked else None  # built before the update, as a model does
    cache.update(k, v, 0)
    return hfkv_attention(module, q, k, v, mask, scaling=scaling)[0]


def _assert_same(a, b) -> None:
    """What layer 0 holds, read through its public views (a freed page's stale bytes are nobody's state): each
    position's state and score, the keys and values as held (dequantized), the tier counts and the policy's step."""
    la, lb = a.layers[0], b.layers[0]
    assert la.length == lb.length and la.policy.steps == lb.policy.steps and la.policy.runs == lb.policy.runs
    assert torch.equal(a.token_states(0), b.token_states(0))
    assert torch.equal(a.token_scores(0).nan_to_num(-1.0), b.token_scores(0).nan_to_num(-1.0))
    assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
    assert torch.equal(la.tiers.counts, lb.tiers.counts)


CASES = [(p, b, m) for p in PRESETS for b in ("torch", "cpu") for m in (False, True)] + [("hfkv", "triton", False)]


@pytest.mark.parametrize(("preset", "backend", "masked"), CASES)
def test_a_recorded_chunk_is_attended_as_greedy_steps_and_cropped_exactly(preset, backend, masked):
    """A chunk after the prompt, recorded, is attended a token at a time: its outputs are the single-token steps'
    and cropping it leaves the layer bit for bit as the kept tokens alone would (recorded or stepped plainly);
    the next step then gives the same output. Without the record the same crop is refused."""
    model = tiny_model("llama")
    module = model.model.layers[0].self_attn
    (pk, pv, pq), (ck, cv, cq), scaling = _inputs(model)

    def make(record: bool):
        cache = hfkv.TriStateCache(model, preset, backend=backend, **PRESETS[preset])
        _forward(cache, module, pk, pv, pq, scaling, masked)
        if record:
            cache.activate_past_recording()
        return cache

    cropped, kept, steps = make(True), make(True), make(False)
    assert cropped.layers[0].window is not None  # the prompt is stored compressed: a plain crop cannot undo
    out = _forward(cropped, module, ck, cv, cq, scaling, masked)
    assert cropped.is_croppable
    cropped.crop(-(CHUNK - KEEP))
    _forward(kept, module, ck[:, :, :KEEP], cv[:, :, :KEEP], cq[:, :, :KEEP], scaling, masked)
    stepped = [
        _forward(steps, module, ck[:, :, t : t + 1], cv[:, :, t : t + 1], cq[:, :, t : t + 1], scaling, masked)
        for t in range(CHUNK)
    ]
    assert torch.equal(out, torch.cat(stepped, 1))  # [B, q, Hq, D]: the chunk's rows are the steps' outputs
    assert cropped.get_seq_length() == kept.get_seq_length() == PROMPT + KEEP
    _assert_same(cropped, kept)
    plain = make(False)
    for t in range(KEEP):
        _forward(plain, module, ck[:, :, t : t + 1], cv[:, :, t : t + 1], cq[:, :, t : t + 1], scaling, masked)
    _assert_same(cropped, plain)
    nxt = [t[:, :, KEEP : KEEP + 1] for t in (ck, cv, cq)]
    assert torch.equal(_forward(cropped, module, *nxt, scaling, masked), _forward(plain, module, *nxt, scaling, masked))
    with pytest.raises(ValueError, match="cannot be cropped by 1 tokens"):
        steps.crop(-1)  # recorded nothing: stored tokens cannot come back


def test_crop_zero_ends_the_record_and_record_past_false_drops_it():
    """``crop(0)`` (each accepted round) ends the record: a later crop reaches back only to the next update; and
    ``record_past = False`` (what generate sets when it hands the cache back) stops recording."""
    model = tiny_model("llama")
    module = model.model.layers[0].self_attn
    (pk, pv, pq), (ck, cv, cq), scaling = _inputs(model, seed=1)
    cache = hfkv.TriStateCache(model, "quant", **PRESETS["quant"])
    _forward(cache, module, pk, pv, pq, scaling, False)
    cache.activate_past_recording()
    _forward(cache, module, ck[:, :, :2], cv[:, :, :2], cq[:, :, :2], scaling, False)
    cache.crop(0)
    _forward(cache, module, ck[:, :, 2:], cv[:, :, 2:], cq[:, :, 2:], scaling, False)
    with pytest.raises(ValueError, match="recorded only its last 3 tokens"):
        cache.crop(-4)
    cache.crop(-3)
    assert cache.get_seq_length() == PROMPT + 2
    dense = hfkv.TriStateCache(model, "hfkv", budget=4096)  # held dense: a crop past the record crops as DynamicLayer
    _forward(dense, module, pk, pv, pq, scaling, False)
    dense.activate_past_recording()
    _forward(dense, module, ck[:, :, :2], cv[:, :, :2], cq[:, :, :2], scaling, False)
    dense.crop(-4)
    assert dense.get_seq_length() == PROMPT - 2 and not dense.layers[0].rollback.holds()
    for layer in cache.layers:  # as transformers' DeferredStopCheck.finish does
        layer.record_past = False
    _forward(cache, module, ck[:, :, 2:3], cv[:, :, 2:3], cq[:, :, 2:3], scaling, False)
    assert not cache.layers[0].rollback.holds() and not cache.is_croppable


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_assisted_and_prompt_lookup_decoding_give_greedys_tokens_with_a_compressing_cache(preset, backend):
    """generate() records the past and crops rejected candidates: with a compressing preset that stores tokens
    compressed during generation, assisted decoding (another model's candidates) and prompt lookup give the tokens
    of greedy decoding with the same preset. The prompt and first candidates fit the window: the first forward
    carries both, and the cache cannot tell them apart (docs/generate.md, "Assisted decoding")."""
    model, assistant = tiny_model("llama"), tiny_model("llama", seed=1)
    ids = torch.randint(3, 128, (1, 3), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=40, do_sample=False)

    def make():
        return hfkv.TriStateCache(model, preset, backend=backend, **GENERATE[preset])

    cache = make()
    ref = model.generate(ids, past_key_values=cache, **kw)
    assert not cache.is_croppable or preset == "hfkv"  # compressed by the end (hfkv: past its budget of 16)
    assert cache.layers[0].window is not None
    out = model.generate(
        ids, past_key_values=make(), assistant_model=assistant, num_assistant_tokens=3,
        num_assistant_tokens_schedule="constant", **kw,
    )  # fmt: skip
    assert torch.equal(out, ref)
    text = torch.cat([ids, ids, ids], 1)  # repeats: prompt lookup finds candidates
    ref = model.generate(text, past_key_values=make(), **kw)
    assert torch.equal(model.generate(text, past_key_values=make(), prompt_lookup_num_tokens=3, **kw), ref)
