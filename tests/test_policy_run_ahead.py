"""A policy run prepared a step ahead (``PolicyRunner.prepare_ahead``) decides and stores what a run made whole
at its own step does: the same tokens, the same tiers, the same statistics, and a prepared run whose step never
comes (a new turn, rows reordered) is dropped, not used.

The reference is the same cache with ``TriStateConfig.run_ahead`` off (the whole run at its step, as the torch
backend's equality tests check it); on a CPU the Triton kernels run in the interpreter, so the models are tiny.
"""

from __future__ import annotations

import pytest
import torch

from hfkv import TriStateCache
from hfkv.cache import TriStateLayer
from hfkv.layer.policy_runner import PolicyRunner
from tests.models import left_padded_batch, tiny_model

# budgets small enough that runs demote and evict, windows short enough that they run every interval
PRESETS = {
    "arkv": {"budget": 20, "window": 4, "interval": 4},
    "hfkv": {"budget": 16, "window": 4, "interval": 4},
    "diffkv": {"window": 4, "obs_window": 8, "interval": 4},
    # unpadded, each layer's runs at its own steps: a step prepares one layer's run and finishes another's
    "hfkv-stagger": {"budget": 16, "window": 4, "interval": 4, "stagger": True},
}


class WholeRuns:
    """Counts policy runs made whole at their step (those finished from a prepared plan: ``layer.runs_ahead``)."""

    def __init__(self, monkeypatch) -> None:
        self.n = 0
        whole = PolicyRunner.run_whole

        def counted(runner, *args):
            self.n += 1
            return whole(runner, *args)

        monkeypatch.setattr(PolicyRunner, "run_whole", counted)


def _runs_ahead(cache: TriStateCache) -> int:
    return sum(layer.runs_ahead for layer in cache.layers if isinstance(layer, TriStateLayer))


def _state(cache: TriStateCache):
    st = cache.stats()
    layers = [layer for layer in cache.layers if isinstance(layer, TriStateLayer)]
    return (
        st.kv_bytes,
        [(ls.window, ls.original, ls.quantized, ls.evicted) for ls in st.layers],
        [layer.token_states() for layer in layers],
        [layer.budget.tier_peak for layer in layers],
    )


def _generate(model, ids, mask, preset, ahead: bool, new_tokens: int = 10):
    cache = TriStateCache(model, preset.split("-")[0], backend="triton", run_ahead=ahead, **PRESETS[preset])
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False)
    return out, cache


# DiffKV's case is test_runs_whose_exits_wrap_around_the_ring_are_prepared_too (runs that wrap and runs that do not)
CASES = [("arkv", True), ("hfkv", True), ("hfkv-stagger", False)]


@pytest.mark.slow
@pytest.mark.parametrize(("preset", "padded"), CASES)
def test_runs_prepared_ahead_decide_and_store_as_whole_runs(preset, padded, monkeypatch):
    model = tiny_model("llama", num_hidden_layers=2 if "stagger" in preset else 1)
    if padded:
        ids, mask = left_padded_batch(lengths=(28, 19))
    else:
        ids = torch.randint(3, 128, (2, 26), generator=torch.Generator().manual_seed(4))
        mask = torch.ones_like(ids)
    whole = WholeRuns(monkeypatch)
    ref, ref_cache = _generate(model, ids, mask, preset, False)
    assert _runs_ahead(ref_cache) == 0 and whole.n > 0
    whole_runs, whole.n = whole.n, 0
    got, got_cache = _generate(model, ids, mask, preset, True)
    assert torch.equal(got, ref)
    a, b = _state(got_cache), _state(ref_cache)
    assert a[0] == b[0] and a[1] == b[1] and a[3] == b[3]
    assert all(torch.equal(x, y) for x, y in zip(a[2], b[2], strict=True))
    assert _runs_ahead(got_cache) + whole.n == whole_runs  # the same runs, at the same steps
    # every run counted once in policy_runs (what benchmarks report beside runs_ahead), made whole or finished ahead
    assert [sum(layer.policy_runs for layer in c.layers) for c in (ref_cache, got_cache)] == [whole_runs] * 2
    assert _runs_ahead(got_cache) > 0  # padded too: the decode-time exits lie past the longest padding
    totals = [ls.totals() for ls in got_cache.stats().layers]
    assert sum(t["mid"] + t["quantized"] + t["evicted"] for t in totals) > 0  # the runs moved tokens


def _step(model, cache, token: torch.Tensor) -> torch.Tensor:
    logits = model(token, past_key_values=cache, use_cache=True).logits
    return logits[:, -1].argmax(-1, keepdim=True)


def _prepared(cache: TriStateCache) -> bool:
    return any(layer.policy.ahead is not None for layer in cache.layers)


@pytest.mark.slow
@pytest.mark.parametrize("then", ["new_turn", "reordered_rows"])
def test_a_prepared_run_whose_step_never_comes_is_dropped(then):
    """Decode until some layer holds a prepared run, then do what its step would not: a multi-token turn, or the
    rows reordered (beam search). Both caches, with and without runs ahead, must go on alike."""
    model = tiny_model("llama", num_hidden_layers=1)
    ids = torch.randint(3, 128, (2, 26), generator=torch.Generator().manual_seed(7))
    results = []
    for ahead in (True, False):
        cache = TriStateCache(model, "arkv", backend="triton", run_ahead=ahead, **PRESETS["arkv"])
        token = _step(model, cache, ids)
        steps = 0
        # the step before a run: with runs ahead some layer has one prepared (the same step count without)
        while not (_prepared(cache) if ahead else steps == results[0][0]):
            token = _step(model, cache, token)
            steps += 1
            assert steps < 64
        if then == "new_turn":
            turn = torch.cat([token, torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(2))], 1)
            token = _step(model, cache, turn)
        else:
            cache.reorder_cache(torch.tensor([1, 0]))
            token = token.flip(0)
            assert not _prepared(cache)
        tokens = [token]
        for _ in range(6):
            tokens.append(_step(model, cache, tokens[-1]))
        results.append((steps, torch.cat(tokens, 1), _state(cache)))
    (_, got, got_state), (_, ref, ref_state) = results
    assert torch.equal(got, ref)
    assert got_state[:2] == ref_state[:2] and got_state[3] == ref_state[3]
    assert all(torch.equal(x, y) for x, y in zip(got_state[2], ref_state[2], strict=True))


@pytest.mark.slow
def test_runs_whose_exits_wrap_around_the_ring_are_prepared_too():
    """A run made by hand a step early pops one exit fewer than an interval, so the ring's later runs pop exits that
    wrap around its end (every other one here). Those are prepared too, from both pieces in order, and decide and
    store what runs made whole do (DiffKV: each exit's state follows its own score, so an exit order that differs
    from the run's would store other states)."""
    preset = "diffkv"
    model = tiny_model("llama", num_hidden_layers=1)
    ids = torch.randint(3, 128, (2, 26), generator=torch.Generator().manual_seed(5))
    results = []
    for ahead in (True, False):
        cache = TriStateCache(model, preset, backend="triton", run_ahead=ahead, **PRESETS[preset])
        layer = cache.layers[0]
        interval, window = layer.cfg.interval, layer.cfg.window
        token = _step(model, cache, ids)
        while layer.steps_since_policy != interval - 1:
            token = _step(model, cache, token)
        layer.run_policy()  # a step early: the ring's phase shifts by one exit
        runs, ahead_before, wrapped, tokens = layer.policy_runs, layer.runs_ahead, 0, []
        for _ in range(3 * interval):
            win = layer.window
            if layer.steps_since_policy == interval - 1:  # the next step runs the policy on count + 1 - window exits
                wrapped += win.start + win.count + 1 - window > win.capacity
            token = _step(model, cache, token)
            tokens.append(token)
        results.append((torch.cat(tokens, 1), _state(cache)))
        totals = [ls.totals() for ls in cache.stats().layers]
        assert sum(t["mid"] + t["quantized"] + t["evicted"] for t in totals) > 0  # the runs moved tokens
        if ahead:
            assert wrapped >= 1  # the case under test happened
            assert layer.runs_ahead - ahead_before == layer.policy_runs - runs > 0  # every later run, prepared
        else:
            assert layer.runs_ahead == 0
    (got, a), (ref, b) = results
    assert torch.equal(got, ref)
    assert a[0] == b[0] and a[1] == b[1] and a[3] == b[3]
    assert all(torch.equal(x, y) for x, y in zip(a[2], b[2], strict=True))
