"""A Triton decode step between policy runs can be replayed: what a CUDA graph of one step needs, checked on a CPU.

A CUDA graph replays the launches it captured with the arguments they had. So a layer's decode step is
replayable when (1) consecutive steps launch with the same arguments (no host number that changes per step
is a launch argument: the position and ring slot come from the device), (2) re-running one step's recorded
launches on the next token's inputs, plus the host bookkeeping ``replayed_step()`` does, leaves the layer
exactly where an eager step leaves it, and (3) the host knows how many steps a graph may replay before a
policy run (``decode_steps_before_policy``). Launches run in Triton's interpreter here; on a GPU,
``hfkv.kernels.gpu_check`` replays real graphs against eager decoding.
"""

from __future__ import annotations

import pytest
import torch

from hfkv import TriStateCache
from hfkv.attention.interface import set_pending
from hfkv.kernels.backend import interpreter_on
from tests.models import tiny_model

pytestmark = pytest.mark.skipif(not interpreter_on(), reason="launches are recorded in Triton's interpreter (CPU)")


def _prefilled(seed: int = 0, **overrides) -> TriStateCache:
    torch.manual_seed(seed)
    model = tiny_model("llama")
    cfg = dict(backend="triton", budget=16, window=4, interval=6) | overrides
    cache = TriStateCache(model, "hfkv", **cfg)
    model(torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(1)), past_key_values=cache)
    return cache


def _inputs(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(2, h, 1, 32, generator=g) for h in (2, 2, 4)) for _ in range(n)]


def _step(layer, k, v, q) -> torch.Tensor:
    layer.update(k, v)
    set_pending(None)  # what the hfkv attention function does before calling attend()
    return layer.attend(None, q, k, v, None, 32**-0.5)


class _Recorder:
    """Triton launches recorded (and, with ``run``, run): the function, its arguments and launch options."""

    def __init__(self, monkeypatch, run: bool):
        from triton.runtime.interpreter import InterpretedFunction

        self.original = InterpretedFunction.run
        self.launches: list[tuple] = []
        recorder = self

        def record(fn, *args, grid, warmup, **kwargs):
            recorder.launches.append((fn, args, dict(kwargs, grid=grid, warmup=warmup)))
            if run:
                return recorder.original(fn, *args, grid=grid, warmup=warmup, **kwargs)

        monkeypatch.setattr(InterpretedFunction, "run", record)

    def take(self) -> list[tuple]:
        out, self.launches = self.launches, []
        return out

    def replay(self, launches) -> None:
        for fn, args, kwargs in launches:
            self.original(fn, *args, **kwargs)


def _state(layer) -> list[torch.Tensor]:
    """What a step may change: the ring, the pool's bytes, the tiers' counts and tables (not the free-page
    stack, whose entries above its top are whatever the allocation left)."""
    tiers = layer.tiers
    return [*layer.window.held_tensors(), tiers.pool.data, tiers.counts, *tiers.tables]


def _flat(x):
    if isinstance(x, (tuple, list)):
        for i in x:
            yield from _flat(i)
    else:
        yield x


def test_consecutive_decode_steps_launch_with_the_same_arguments(monkeypatch):
    """Fed from the same input buffers (a graph's static inputs), two steps between policy runs make the same
    launches: same kernels, grids, constants, numbers and tensors (the step's fresh output buffer aside)."""
    cache = _prefilled()
    layer = cache.layers[0]
    bufs = [t.clone() for t in _inputs(1)[0]]
    steps = []
    for i, new in enumerate(_inputs(4, seed=1)):
        for b, t in zip(bufs, new, strict=True):
            b.copy_(t)
        assert layer.decode_steps_before_policy() >= 1
        if i < 2:  # the first steps build the plan and set the device step
            _step(layer, *bufs)
            continue
        rec = _Recorder(monkeypatch, run=False)
        before = {t.data_ptr() for t in (*bufs, *layer.held_tensors(), layer._step_dev)}
        _step(layer, *bufs)
        steps.append((rec.take(), before))
        monkeypatch.undo()
    (a, before), (b, _) = steps
    assert [fn for fn, _, _ in a] == [fn for fn, _, _ in b] and len(a) == 3
    for (_, args_a, kw_a), (_, args_b, kw_b) in zip(a, b, strict=True):
        assert kw_a == kw_b  # grid and constants
        for x, y in zip(_flat(args_a), _flat(args_b), strict=True):
            if isinstance(x, torch.Tensor):
                fresh = x.data_ptr() not in before  # allocated by the step (the output): a graph's pool fixes it
                assert fresh or x.data_ptr() == y.data_ptr()
                assert (x.shape, x.dtype) == (y.shape, y.dtype)
            else:
                assert x == y  # before the device step: q_start, the ring slot and the position differed


def test_replaying_a_steps_launches_is_the_next_eager_step(monkeypatch):
    """Step t run eagerly with its launches recorded; step t+1 as a graph would: the next token's inputs copied
    into the same buffers, the recorded launches run again, ``replayed_step()``. Output, ring, tiers' bytes and
    the host's counters equal a twin cache's eager step t+1, several steps in a row (ring slots wrapping)."""
    eager, graphed = _prefilled(), _prefilled()
    le, lg = eager.layers[0], graphed.layers[0]
    new = _inputs(8, seed=2)
    for t in range(2):  # plan built, device step set
        torch.testing.assert_close(_step(lg, *new[t]), _step(le, *new[t]), atol=0, rtol=0)
    left = lg.decode_steps_before_policy()
    assert left >= 3
    bufs = [x.clone() for x in new[2]]
    rec = _Recorder(monkeypatch, run=True)
    out_g = _step(lg, *bufs)  # the captured step
    launches = rec.take()
    monkeypatch.undo()
    torch.testing.assert_close(out_g, _step(le, *new[2]), atol=0, rtol=0)
    fills = lg.step_fills
    for t in range(3, 2 + left):
        for b, x in zip(bufs, new[t], strict=True):
            b.copy_(x)
        _Recorder(monkeypatch, run=True).replay(launches)
        monkeypatch.undo()
        lg.replayed_step()
        want = _step(le, *new[t])
        torch.testing.assert_close(out_g, want, atol=0, rtol=0)  # the recorded output buffer, rewritten
        for x, y in zip(_state(lg), _state(le), strict=True):
            torch.testing.assert_close(x, y, atol=0, rtol=0)
        assert (lg.length, lg.window.start, lg.window.count, lg.steps_since_policy) == (
            le.length, le.window.start, le.window.count, le.steps_since_policy
        )  # fmt: skip
        assert lg._step_next == le._step_next and torch.equal(lg._step_dev, le._step_dev)
    assert lg.step_fills == fills  # the device step was never set from the host while replaying
    assert lg.decode_steps_before_policy() == 0
    with pytest.raises(RuntimeError, match="cannot take a replayed step here"):
        lg.replayed_step()  # the next step runs the policy: a graph must not stand in for it


@pytest.mark.parametrize("overrides", [{"interval": 4}, {"budget": 20, "interval": 10}])
def test_steps_before_policy_match_what_eager_steps_do(overrides):
    """The host's count of policy-free steps ahead, taken before each step of a run through several policy runs,
    is 0 exactly at the steps that run the policy and counts down one a step in between."""
    layer = _prefilled(**overrides).layers[0]
    predicted, ran, filled = [], [], []
    for k, v, q in _inputs(22, seed=3):
        predicted.append(layer.decode_steps_before_policy())
        fills = layer.step_fills
        _step(layer, k, v, q)
        ran.append(layer.steps_since_policy == 0)
        filled.append(layer.step_fills > fills)
    assert sum(ran) >= 2
    assert [p == 0 for p in predicted] == ran
    assert all(a == b + 1 for a, b in zip(predicted[:-1], predicted[1:], strict=True) if a > 0)
    # the device step is set from the host on the first step and in the steps that run the policy (whose token
    # a tensor op wrote), never in the steps after them: a graph captured there replays what the next ones do
    assert filled[0] and filled[1:] == ran[1:]
