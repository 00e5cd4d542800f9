"""A Triton decode step between policy runs can be replayed: what a CUDA graph of one step needs, checked on a CPU.

A CUDA graph replays the launches it captured with the arguments they had. So a layer's decode step is
replayable when (1) consecutive steps launch with the same arguments (no host number that changes per step
is a launch argument: the position and ring slot come from the device), (2) re-running one step's recorded
launches on the next token's inputs, plus the host bookkeeping ``replayed_step()`` does, leaves the layer
exactly where an eager step leaves it, and (3) the host knows how many steps a graph may replay before a
policy run (``decode_steps_before_policy``). Launches run in Triton's interpreter here; on a GPU,
the GPU check (``eval/gpu/check.py``) replays real graphs against eager decoding.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from hfkv import TriStateCache
from hfkv.attention.interface import set_pending
from hfkv.kernels.environment import interpreter_on
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
        before = {t.data_ptr() for t in (*bufs, *layer.held_tensors(), layer.cursor.dev)}
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
        assert lg.cursor.next == le.cursor.next and torch.equal(lg.cursor.dev, le.cursor.dev)
    assert lg.step_fills == fills  # the device step was never set from the host while replaying
    assert lg.decode_steps_before_policy() == 0
    with pytest.raises(RuntimeError, match="cannot take a replayed step here"):
        lg.replayed_step()  # the next step runs the policy: a graph must not stand in for it


@pytest.mark.parametrize(
    "overrides, n",
    [({"interval": 4}, 13), ({"budget": 20, "interval": 10}, 22), ({"interval": 4, "stagger": True}, 13)],
)
def test_steps_before_policy_match_what_eager_steps_do(overrides, n):
    """The host's count of policy-free steps ahead, taken before each step of a run through several policy runs,
    is 0 exactly at the steps that run the policy and counts down one a step in between (staggered: at the
    steps whose length is the layer's index modulo the interval)."""
    layer = _prefilled(**overrides).layers[-1]
    predicted, ran, filled, lengths = [], [], [], []
    for k, v, q in _inputs(n, seed=3):
        predicted.append(layer.decode_steps_before_policy())
        fills = layer.step_fills
        _step(layer, k, v, q)
        ran.append(layer.steps_since_policy == 0)
        filled.append(layer.step_fills > fills)
        lengths.append(layer.length)
    assert sum(ran) >= 2
    if overrides.get("stagger"):
        interval = overrides["interval"]
        assert layer.layer_idx % interval and ran == [(n - layer.layer_idx) % interval == 0 for n in lengths]
    assert [p == 0 for p in predicted] == ran
    assert all(a == b + 1 for a, b in zip(predicted[:-1], predicted[1:], strict=True) if a > 0)
    # the device step is set from the host on the first step only: the steps that run the policy keep their
    # token pending for the kernel, so they launch as every other step does
    assert filled[0] and not any(filled[1:])


# ------------------------------------------------------------------------------ the decoder on a recorded step
class _Tape:
    """A CUDA graph's semantics on a CPU. Capture records the step's aten ops and Triton launches and runs the
    launches not at all (as a capture runs nothing); a host read of a device value fails, as it does in a
    capture; and when the capture ends, every floating tensor its ops made holds NaN, as a captured tensor holds
    garbage until the graph is replayed. Replay runs the record again with every tensor where the capture left
    it, each op's result copied into the tensor the capture made (a graph's fixed addresses), the launches on
    those same tensors."""

    def __init__(self, run_launch):
        self.ops: list[tuple] = []
        self.run_launch = run_launch

    def replay(self) -> None:
        for kind, fn, args, kwargs, out in self.ops:
            if kind == "triton":
                self.run_launch(fn, *args, **kwargs)
                continue
            res = fn(*args, **kwargs)
            for o, r in zip(_tensors(out), _tensors(res), strict=True):
                if o.data_ptr() != r.data_ptr():
                    o.copy_(r)


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in _flat(x) if isinstance(t, torch.Tensor)]


class _TapeGraphs:
    """Graphs as tapes, and torch's rule for a graph pool: once captured into, a pool takes another capture only
    while some graph captured into it is alive (else CUDACachingAllocator asserts ``use_count > 0``)."""

    requires_cuda = False

    def __init__(self) -> None:
        self.pools: list = []  # pools captured into (kept, so no id is reused)
        self.holders: dict[int, weakref.WeakSet] = {}  # each pool's live graphs

    def pool(self):
        return object()

    def new(self) -> _Tape:
        from triton.runtime.interpreter import InterpretedFunction

        return _Tape(InterpretedFunction.run)

    def capture(self, tape: _Tape, pool):
        import contextlib

        if id(pool) in self.holders and not self.holders[id(pool)]:
            raise AssertionError("capture into a graph pool that no live graph holds (use_count > 0 assert)")
        if id(pool) not in self.holders:
            self.pools.append(pool)
            self.holders[id(pool)] = weakref.WeakSet()
        self.holders[id(pool)].add(tape)

        from torch.utils._python_dispatch import TorchDispatchMode
        from triton.runtime.interpreter import InterpretedFunction

        made: list[torch.Tensor] = []  # tensors the capture's ops allocated (not views or in-place results)

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
                    raise AssertionError(f"host read of a device value during a capture: {func}")
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                tape.ops.append(("aten", func, args, kwargs, out))
                given = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
                made.extend(t for t in _tensors(out) if t.untyped_storage().data_ptr() not in given)
                return out

        @contextlib.contextmanager
        def recording():
            original = InterpretedFunction.run

            def record(fn, *args, grid, warmup, **kwargs):
                tape.ops.append(("triton", fn, args, dict(kwargs, grid=grid, warmup=warmup), None))

            InterpretedFunction.run = record
            try:
                with Record():
                    yield
            finally:
                InterpretedFunction.run = original
                for t in made:  # nothing ran on a GPU's capture: what the step made is garbage until a replay
                    if t.is_floating_point():
                        t.fill_(float("nan"))

        return recording()


def _graphed_against_eager(model, n: int, mode: str, **overrides):
    """``n`` greedy tokens decoded eagerly and by a GraphedDecoder in ``mode`` on recorded graphs, from caches whose
    budget the prompt does not fill (policy runs during decoding grow the pool and tables, then leave them):
    asserts tokens, token states and every layer's storage equal; gives the decoder, the eager cache's distinct
    storage shapes (after each step) and its policy runs."""
    from hfkv.evaluation.bench import decode_step
    from hfkv.graphs import GraphedDecoder

    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(1))
    cfg = dict(backend="triton", budget=48, window=4, interval=6, dense_phase=False) | overrides
    caches = [TriStateCache(model, "hfkv", **cfg) for _ in range(2)]
    storages, runs = set(), 0
    with torch.inference_mode():
        out = model(input_ids=ids, past_key_values=caches[0], use_cache=True, logits_to_keep=1)
        eager = [out.logits[:, -1:].argmax(-1)]
        for i in range(n - 1):
            eager.append(decode_step(model, caches[0], eager[-1], ids.shape[1] + i))
            tiers = caches[0].layers[0].tiers
            if tiers is not None:  # None while the layer holds its sequence dense (hfkv.layer.dense)
                storages.add((tiers.pool.data.shape, *(t.shape for t in tiers.tables)))
            runs += caches[0].layers[0].steps_since_policy == 0
    decoder = GraphedDecoder(model, caches[1], graphs=_TapeGraphs(), mode=mode)
    got = decoder.generate(ids, n)
    assert torch.equal(got, torch.cat(eager, dim=1))
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(a.token_states(), b.token_states())
        for x, y in zip(_state(a), _state(b), strict=True):  # scores and bytes too: a stale table reads elsewhere
            assert torch.equal(x, y)
    return decoder, storages, runs


def test_step_graphs_on_recorded_steps_equal_eager_decoding():
    """GraphedDecoder(mode="steps")'s choices (eager for a policy step and the first step, capture, replays, the host's
    bookkeeping, the graph kept across a policy run that changed no table and dropped after one that did) over
    several policy runs, with a recording standing in for CUDA graphs: the tokens and every layer's token
    states are eager decoding's."""
    model = tiny_model("llama", num_hidden_layers=1)
    n = 20
    decoder, storages, runs = _graphed_against_eager(model, n, "steps")
    assert len(storages) > 1  # a policy run changed a table or the pool: the graph cannot serve past it
    # interval 6: the first step and the policy steps eager; a capture after the first step and after each run
    # that changed the pool or a table; the graph reused after every other run; all other steps replays
    c = decoder.counts
    assert runs >= 3 and c["eager"] == 1 + runs and c["captured"] == len(storages)
    assert c["reused"] == runs - (len(storages) - 1) >= 1 and c["eager"] + c["captured"] + c["replayed"] == n - 1
    # the eager policy steps finish runs prepared after the replayed step before them (run_ahead)
    assert sum(layer.runs_ahead for layer in decoder.layers) > 0


@pytest.mark.parametrize(
    "family, overrides, n",
    [
        ("llama", {}, 14),
        ("qwen3", {}, 14),
        ("llama", {"stagger": True, "budget": 38}, 13),
        ("llama", {"dense_phase": True}, 20),  # dense steps until the 11th outgrows the budget, then the tiers'
    ],
)
def test_layer_graphs_on_recorded_steps_equal_eager_decoding(family, overrides, n):
    """GraphedDecoder's default mode: one capture of the step in pieces between the cache's calls, then every
    step replays the pieces with each layer's update() and attend() run eagerly between them (policy runs,
    grown pools and tables included), with a recording standing in for CUDA graphs (a host read inside a piece
    fails it): the tokens and every layer's token states, ring, pool bytes, counts and tables are eager
    decoding's. Two layers, so a piece runs from one layer's attention to the next one's projections; staggered
    policy runs too (the layers' runs in different steps), under a budget the decoding outgrows (runs prepared a step
    ahead by the eager attend() calls); and a cache that holds the prompt dense until the decoding outgrows it."""
    model = tiny_model(family, num_hidden_layers=2)
    decoder, storages, runs = _graphed_against_eager(model, n, "layers", **overrides)
    assert runs >= 2 and len(storages) > 1  # policy runs, and storage that grew under the graphs
    assert decoder.counts == {"eager": 0, "captured": 1, "replayed": n - 2, "reused": 0}
    assert len(decoder._pieces) == len(decoder._calls) + 1 == 3
    if "budget" in overrides:  # a budget the decoding outgrows: runs rank, prepared by the eager attend() calls
        assert sum(layer.runs_ahead for layer in decoder.layers) > 0


def test_graphed_decoder_refuses_what_it_cannot_replay():
    from transformers import DynamicCache

    from hfkv.graphs import GraphedDecoder

    model = tiny_model("llama")
    with pytest.raises(TypeError, match="cache must be a TriStateCache, got DynamicCache"):
        GraphedDecoder(model, DynamicCache())
    with pytest.raises(ValueError, match="every layer must be a compressed TriStateLayer"):
        GraphedDecoder(model, TriStateCache(model, "full"))
    decoder = GraphedDecoder(model, TriStateCache(model, "hfkv", backend="triton", budget=16, window=4))
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device; tokens are on cpu"):
        decoder.generate(torch.randint(3, 128, (1, 30)), 4)
