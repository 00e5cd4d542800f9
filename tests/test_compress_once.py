"""Compress once, ask many: a cache copied with ``fork()`` or written with ``save()`` and read with ``load()`` resumes
exactly where the original was (docs/generate.md, "Compress once, ask many"), on the torch and CPU backends and on
Triton's (its interpreter here)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import hfkv
from hfkv.cache_state import capture
from tests.models import tiny_model

CONTEXT, QUESTION = 96, 6
# Stored and compressing (evicts and quantizes), held dense (the budget covers the context), uncompressed.
CASES = {
    "hfkv-stored": ("hfkv", dict(budget=24, window=4)),
    "diffkv-stored": ("diffkv", dict(budget=48, window=4, obs_window=8)),
    "hfkv-dense": ("hfkv", dict(budget=4096)),
    "full": ("full", {}),
}
# Triton's interpreter is slow: it runs the stored case, which reads pages (the others hold tensors as DynamicCache).
COMBOS = [(c, b) for c in CASES for b in ("torch", "cpu")] + [("hfkv-stored", "triton")]


def _ids(n: int, seed: int, rows: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (rows, n), generator=torch.Generator().manual_seed(seed))


def _cache(model, case: str, backend: str) -> hfkv.TriStateCache:
    preset, kw = CASES[case]
    return hfkv.TriStateCache(model, preset, **(kw if preset == "full" else dict(kw, backend=backend)))


@torch.no_grad()
def _compressed(model, case: str, backend: str, context: torch.Tensor) -> hfkv.TriStateCache:
    cache = _cache(model, case, backend)
    model(input_ids=context, past_key_values=cache)
    return cache


def _answer(model, cache, context, question, new: int = 6) -> torch.Tensor:
    ids = torch.cat([context.expand(question.shape[0], -1), question], 1)
    return model.generate(ids, past_key_values=cache, max_new_tokens=new, do_sample=False)[:, ids.shape[1] :]


def _snapshot(cache) -> dict[str, torch.Tensor]:
    tensors, layers = capture(cache)
    return {k: t.clone() for k, t in tensors.items()}, layers


@pytest.mark.parametrize(("case", "backend"), COMBOS)
def test_a_fork_answers_as_a_fresh_compression_and_leaves_the_original_bit_identical(case, backend):
    model, context = tiny_model("llama"), _ids(CONTEXT, 0)
    cache = _compressed(model, case, backend, context)
    before, values = _snapshot(cache)
    questions = [_ids(QUESTION, s) for s in ((1,) if backend == "triton" else (1, 2))]  # the interpreter: one
    for q in questions:  # each question from its own fork, against compressing the context afresh for it
        got = _answer(model, cache.fork(), context, q)
        want = _answer(model, _compressed(model, case, backend, context), context, q)
        assert torch.equal(got, want)
    after, values_after = capture(cache)
    assert values_after == values and after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)  # the original, bit for bit
    if backend == "triton":
        return
    # Two questions in one batch from fork(repeats=2): each row as its own fork answered it.
    both = _answer(model, cache.fork(repeats=2), context, torch.cat(questions))
    for row, q in enumerate(questions):
        assert torch.equal(both[row : row + 1], _answer(model, cache.fork(), context, q))


@pytest.mark.parametrize(("case", "backend"), [c for c in COMBOS if c[0] != "diffkv-stored"])
def test_save_then_load_gives_the_same_logits_and_state(case, backend, tmp_path):
    model, context, q = tiny_model("llama"), _ids(CONTEXT, 0), _ids(QUESTION, 1)
    cache = _compressed(model, case, backend, context)
    path = cache.save(tmp_path / "context.safetensors")
    loaded = hfkv.TriStateCache.load(path, model)
    assert loaded.config == cache.config and loaded.get_seq_length() == cache.get_seq_length()
    saved, values = capture(cache)
    got, got_values = capture(loaded)
    assert got_values == values and all(torch.equal(got[k], saved[k]) for k in saved)
    with torch.no_grad():
        want = model(input_ids=q, past_key_values=cache.fork()).logits
        assert torch.equal(model(input_ids=q, past_key_values=loaded).logits, want)
    if backend == "triton":  # the interpreter is slow: the logits above are the check there
        return
    again = hfkv.TriStateCache.load(path, model)  # the first one has taken the question
    assert torch.equal(_answer(model, again, context, q), _answer(model, cache.fork(), context, q))


def test_a_loaded_cache_in_a_new_process_gives_identical_logits(tmp_path):
    model, context, q = tiny_model("llama"), _ids(CONTEXT, 0), _ids(QUESTION, 1)
    cache = _compressed(model, "hfkv-stored", "cpu", context)
    cache.save(tmp_path / "c.safetensors")
    with torch.no_grad():
        torch.save(model(input_ids=q, past_key_values=cache).logits, tmp_path / "want.pt")
    # The same threads as this process: a CPU's sums (the model's and the kernel's) split by thread count.
    script = textwrap.dedent(f"""
        import torch, hfkv
        from tests.models import tiny_model
        torch.set_num_threads({torch.get_num_threads()})
        model = tiny_model("llama")
        cache = hfkv.TriStateCache.load({str(tmp_path / "c.safetensors")!r}, model)
        q = torch.randint(0, 128, (1, {QUESTION}), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            got = model(input_ids=q, past_key_values=cache).logits
        assert torch.equal(got, torch.load({str(tmp_path / "want.pt")!r})), "logits differ"
        print("identical")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "identical" in out.stdout, out.stderr[-2000:]


def test_a_file_for_another_model_or_config_or_a_damaged_one_gets_one_clear_error(tmp_path):
    model, context = tiny_model("llama"), _ids(CONTEXT, 0)
    cache = _compressed(model, "hfkv-stored", "cpu", context)
    path, saved = cache.save(tmp_path / "c.safetensors"), capture(cache)[0]
    with pytest.raises(ValueError, match="made for another model .*weights"):
        hfkv.TriStateCache.load(path, tiny_model("llama", seed=1))  # same shape, other weights
    with pytest.raises(ValueError, match="made for another model .*kv_heads"):
        hfkv.TriStateCache.load(path, tiny_model("llama", num_key_value_heads=4))
    with pytest.raises(ValueError, match=r"another config \(fields \['budget'\]"):
        hfkv.TriStateCache.load(path, model, hfkv.TriStateConfig.from_preset("hfkv", budget=32, window=4))
    # Another backend reads the same bytes: the cache loads, and holds what the file holds.
    other = hfkv.TriStateCache.load(
        path, model, hfkv.TriStateConfig.from_preset("hfkv", budget=24, window=4, backend="torch")
    )
    assert other.backend == "torch"
    assert [t.equal(u) for t, u in zip(capture(other)[0].values(), saved.values(), strict=True)] == [True] * len(saved)
    data = bytearray(path.read_bytes())
    flipped = tmp_path / "flipped.safetensors"
    data[-100] ^= 0xFF  # a byte of the tensors' data
    flipped.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="is damaged"):
        hfkv.TriStateCache.load(flipped, model)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable hfkv cache file"):
        hfkv.TriStateCache.load(cut, model)
    with pytest.raises(FileNotFoundError, match="no file"):
        hfkv.TriStateCache.load(tmp_path / "missing.safetensors", model)
    # The file is written atomically: nothing but it is left in the folder.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors", "cut.safetensors", "flipped.safetensors"]


# --------------------------------------------------------------------------- hfkv.compress: scores without the question
REPEAT = torch.tensor([5, 6, 7, 8])


@torch.no_grad()
def test_reconstruction_scores_are_the_repetitions_largest_attention_on_each_context_token():
    """Against the eager model's own attention weights over context + request + repetition, per chunk (each chunk
    of the repetition follows the context alone): the largest over the chunk's queries and the group's heads."""
    from hfkv.compress_once import score_context

    model = tiny_model("llama", attn_implementation="eager")
    context = _ids(40, 0)
    t, r = context.shape[1], REPEAT.numel()
    for chunk in (40, 16):
        _, got = score_context(model, context, "reconstruction", REPEAT, chunk)
        want = {}
        for start in range(0, t, chunk):
            ids = torch.cat([context, REPEAT.view(1, -1), context[:, start : start + chunk]], 1)
            for i, att in enumerate(model(input_ids=ids, output_attentions=True).attentions):
                heads = model.config.num_key_value_heads
                b, hq, q, k = att.shape
                part = att[:, :, t:, :t].reshape(b, heads, hq // heads, q - t, t).amax(dim=(2, 3))
                want[i] = part if i not in want else torch.maximum(want[i], part)
        assert got.keys() == want.keys()
        for i in want:
            torch.testing.assert_close(got[i], want[i], atol=1e-6, rtol=1e-5)
    assert r == 4


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_compress_with_observation_scores_is_a_plain_prefill(backend):
    model, context = tiny_model("llama"), _ids(CONTEXT, 0)
    got = hfkv.compress(model, context, "hfkv", scores="observation", budget=24, window=4, backend=backend)
    (want, want_values), (have, values) = capture(_compressed(model, "hfkv-stored", backend, context)), capture(got)
    assert values == want_values and have.keys() == want.keys()
    for k in want:  # a free-page stack holds ids below its count (the rest: what its growth left, unread)
        n = want_values[int(k.split(".")[1])]["tiers.pool.n_free"] if k.endswith("free_stack") else None
        assert torch.equal(have[k][:n], want[k][:n]), k


@pytest.mark.parametrize("source", ["key_norm", "reconstruction"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_compress_keeps_what_its_scores_rank_highest_and_answers_from_a_fork(source, backend):
    """Per row and head, no token the scores rank above a kept one is evicted (tokens all observed alike: past the
    sinks, before the context's last queries), within the budget; a fork answers a question."""
    from hfkv.compress_once import score_context
    from hfkv.states import EVICTED

    model, context = tiny_model("llama"), _ids(CONTEXT, 0)
    cache = hfkv.compress(model, context, "hfkv", scores=source, repeat_prompt=REPEAT, chunk=32, budget=24, window=4,
                          backend=backend)  # fmt: skip
    _, scores = score_context(model, context, source, REPEAT, 32)
    evicted_some = False
    for layer in cache.compressed_layers():
        states, score = layer.token_states(), scores[layer.layer_idx]
        lo, hi = layer.cfg.sink_tokens, layer.score_start
        for b, h in zip(*torch.where(torch.ones(states.shape[:2], dtype=torch.bool)), strict=True):
            s, gone = score[b, h, lo:hi], states[b, h, lo:hi] == EVICTED
            if gone.any() and (~gone).any():
                evicted_some = True
                assert s[gone].max() <= s[~gone].min()
    assert evicted_some
    st = cache.stats()
    assert st.kv_bytes < st.dense_bytes
    assert _answer(model, cache.fork(), context, _ids(QUESTION, 1)).shape == (1, 6)


def test_compress_names_what_it_cannot_take():
    model, context = tiny_model("llama"), _ids(8, 0)
    with pytest.raises(ValueError, match="scores='attention' is not one of"):
        hfkv.compress(model, context, scores="attention")
    with pytest.raises(ValueError, match="pass tokenizer="):
        hfkv.compress(model, context, budget=24, window=4)
    with pytest.raises(ValueError, match=r"input_ids must be \[B, T\]"):
        hfkv.compress(model, context[0])


@pytest.mark.parametrize("kind", ["config-less full", "sliding layers"])
def test_fork_and_load_keep_transformers_own_layers(kind, tmp_path):
    """A cache made without a model (its DynamicLayers made as first updated) and a model whose sliding layers stay
    DynamicSlidingWindowLayer: fork and load give the original's logits."""
    if kind == "sliding layers":
        model = tiny_model("gemma2")
        cache = hfkv.TriStateCache(model, "hfkv", budget=24, window=4, backend="cpu")
    else:
        model = tiny_model("llama")
        cache = hfkv.TriStateCache(None, "full")
    context, q = _ids(60, 0), _ids(4, 1)
    with torch.no_grad():
        model(input_ids=context, past_key_values=cache)
        fork, loaded = cache.fork(), hfkv.TriStateCache.load(cache.save(tmp_path / "c.safetensors"), model)
        want = model(input_ids=q, past_key_values=cache).logits
        for other in (fork, loaded):
            assert torch.equal(model(input_ids=q, past_key_values=other).logits, want)
    kinds = {type(layer).__name__ for layer in loaded.layers}
    assert kinds == ({"DynamicSlidingWindowLayer", "TriStateLayer"} if kind == "sliding layers" else {"DynamicLayer"})


@pytest.mark.parametrize("head_adaptive", [False, True], ids=["per-head", "head-adaptive"])
def test_external_scores_keep_their_proportions_across_heads_only_where_heads_share_the_room(head_adaptive):
    """Scores from another source are scaled to the observation window's total (prefill.in_scale): per head where
    each head keeps its own share of the budget, so both heads keep as many tokens; per row under head_adaptive,
    so the head the source scores ten times higher takes the room, as KVzip's ranking across heads would (scaled
    per head there, the two would keep 20 and 18)."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    t, d = 48, model.config.hidden_size // model.config.num_attention_heads
    key, value = torch.randn(1, 2, t, d, generator=g), torch.randn(1, 2, t, d, generator=g)
    query = torch.randn(1, 4, t, d, generator=g)
    scores = torch.rand(1, 2, t, generator=g) + 0.5
    scores[:, 1] *= 0.1  # the source finds head 1 ten times less used
    cache = hfkv.TriStateCache(model, "evict", budget=24, window=4, head_adaptive=head_adaptive, backend="torch")
    cache.layers[0].ingest_prefill(key, value, query, d**-0.5, scores)
    kept = (cache.token_states(0) != 3).sum(-1)[0]  # [heads]: tokens not evicted
    sums = cache.token_scores(0)[0].nan_to_num(0.0)
    if head_adaptive:  # every token of head 0 outranks every one of head 1: head 1 keeps only its window
        assert kept[1] == 4 and kept[0] > kept[1]
    else:
        assert kept[0] == kept[1]
    held = cache.token_states(0)[0] != 3
    assert (sums > 0).eq(held).all()  # what is held was scored
