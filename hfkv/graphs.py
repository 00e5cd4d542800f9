"""Greedy decoding of a TriStateCache whose decode steps replay CUDA graphs.

On a GPU a decode step of an 8B model is bound by its host: transformers' Python and a few hundred
launches take ~25-35 ms where the bytes take ~5-10 (docs/kernels.md, "Tenth lease"), for DynamicCache and
hfkv alike. A CUDA graph removes the host from a step, but only launches that are the same from one step to
the next. DynamicCache's never are (its tensors grow every step). :class:`GraphedDecoder` has two modes.

``mode="layers"`` (default) graphs everything but the cache: the first decode step is captured as one graph
per stretch between two layers' cache calls (the embedding and the first layer's projections, each layer's
output projection, MLP and the next layer's projections, the last norm, head and argmax), and every later
step replays those graphs in order with each layer's ``update()`` and ``attend()`` run eagerly between
them, on the tensors the graphs write, as the model's own attention calls them. Policy runs, grown tables
and pools and new launch plans happen in the eager calls, as in eager decoding, so nothing is captured again
and the model's Python never runs after the first step. A replayed step's host work is the layers' own
(``eval/host_overhead.py``: ~20 us and 3 launches a layer between policy runs) plus one graph launch a layer.

``mode="steps"`` replays one graph of a whole step between policy runs. There a TriStateCache's step launches
alike: its storage does not move, the decode kernels read the step's position and ring slot from the device
(``run_plan(step=...)``), and the host knows how many steps are left before the next policy run
(``TriStateLayer.decode_steps_before_policy``). The step that runs a policy run runs eagerly (its decode
kernels run on the storage the run leaves: the new launch plan is built, what is new compiled), the next one
is captured, and every later step until the next policy run replays it, with the host's bookkeeping
(``TriStateLayer.replayed_step``) in place of ``update()`` and ``attend()``. Where a run grows or shrinks no
layer's page table or pool (``TriStateLayer.launch_signature``: the same launch plan, for the same tensors)
the graph serves on; on a real model some layer's nearly always changes (``eval/storage_churn.py``), so this
mode pays an eager step and a capture every interval. (The first decode step, and a step after one whose
storage changed after its attention, run eagerly before a capture.)

    decoder = GraphedDecoder(model, cache)
    tokens = decoder.generate(input_ids, max_new_tokens=256)     # greedy; [batch, max_new_tokens]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from hfkv.attention.interface import set_pending
from hfkv.cache import TriStateCache, TriStateLayer

MODES = ("layers", "steps")


class CudaGraphs:
    """The part of torch's CUDA graph API the decoder uses (tests put a recording of the step in its place to
    check the decoder's logic on a CPU)."""

    requires_cuda = True

    def pool(self):
        return torch.cuda.graph_pool_handle()

    def new(self) -> torch.cuda.CUDAGraph:
        return torch.cuda.CUDAGraph()

    def capture(self, graph: torch.cuda.CUDAGraph, pool):
        torch.cuda.synchronize()
        return torch.cuda.graph(graph, pool=pool)


@dataclass
class _CacheCall:
    """One layer's ``update()`` and ``attend()`` as the captured step made them: replayed eagerly on the tensors
    the graphs write (keys, values, queries, mask), the attention's result written where the next graph reads it
    (the capture's result tensor: a Triton decode step writes it in place)."""

    layer: TriStateLayer
    key: torch.Tensor
    value: torch.Tensor
    args: tuple
    kwargs: dict
    attend: tuple | None = None  # (module, query, key, value, mask, scaling)
    out: torch.Tensor | None = None

    def run(self) -> None:
        self.layer.update(self.key, self.value, *self.args, **self.kwargs)
        set_pending(None)  # what the hfkv attention function does before calling attend()
        self.layer.attend(*self.attend, out=self.out)  # written where the next graph reads it


class GraphedDecoder:
    """Greedy decoding of ``model`` with ``cache``, its steps replayed from CUDA graphs (``mode``: module docstring).

    Needs every layer compressed (a TriStateLayer: an uncompressed sliding layer grows like DynamicCache's),
    a CUDA device, and for ``mode="steps"`` the Triton backend. ``counts`` says how many steps ran eagerly,
    were captured and were replayed, and after how many policy runs a whole-step graph was reused. Step the
    cache through the decoder only: what it replays was set up at the capture.
    """

    def __init__(self, model: torch.nn.Module, cache: TriStateCache, graphs=None, mode: str = "layers") -> None:
        if mode not in MODES:
            raise ValueError(f"GraphedDecoder: mode={mode!r}; allowed: {MODES}")
        if not isinstance(cache, TriStateCache):
            raise TypeError(f"GraphedDecoder: cache must be a TriStateCache, got {type(cache).__name__}")
        layers = list(cache.layers)
        if not layers or not all(isinstance(layer, TriStateLayer) for layer in layers):
            kinds = sorted({type(layer).__name__ for layer in layers if not isinstance(layer, TriStateLayer)})
            raise ValueError(
                f"GraphedDecoder: every layer must be a compressed TriStateLayer; this cache has {kinds or 'none'} "
                "(a preset with compress=False, or a model with sliding-window layers, grows its tensors every step)"
            )
        self.model, self.cache, self.layers = model, cache, layers
        self.graphs = graphs if graphs is not None else CudaGraphs()
        self.counts = {"eager": 0, "captured": 0, "replayed": 0, "reused": 0}
        self._graph = None
        self._signatures: list[tuple] | None = None  # each layer's launch_signature() at the capture
        self._replays_left = 0
        self._pool = None
        self._held = None  # the last whole-step graph captured, which keeps the pool alive (``_capture``)
        self._warm = False  # an eager step ran on the storage as it is now (plan built, kernels compiled)
        self._tok = self._pos = self._next = None
        self.mode = mode
        self._pieces: list | None = None  # "layers": the graphs between the cache calls, in order
        self._calls: list[_CacheCall] = []

    def _check_ready(self, tokens: torch.Tensor) -> None:
        if self.graphs.requires_cuda and tokens.device.type != "cuda":
            raise ValueError(f"GraphedDecoder: CUDA graphs need a CUDA device; tokens are on {tokens.device}")
        if not all(layer.is_initialized for layer in self.layers):
            raise ValueError("GraphedDecoder: prefill the cache first (generate() does)")
        if self.mode == "steps" and not all(layer.ops.graph_steps for layer in self.layers):
            raise ValueError(
                f"GraphedDecoder: the cache's backend is {self.cache.backend!r}; graphs replay the Triton decode "
                "kernels (backend='triton', or 'auto' on CUDA)"
            )

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """One token per row (``tokens [B, 1]``) at logical ``position``; the next greedy tokens ``[B, 1]``."""
        if self._next is None:
            self._check_ready(tokens)
        if self.mode == "layers":
            return self._step_layers(tokens, position)
        if self._graph is not None and self._replays_left > 0:
            self._tok.copy_(tokens)
            self._pos.fill_(position)
            self._graph.replay()
            for layer in self.layers:  # counted when the graph was captured: no per-layer check here
                layer.replayed_step(checked=False)
            self._replays_left -= 1
            self.counts["replayed"] += 1
            return self._next.clone()
        left = min(layer.decode_steps_before_policy(2) for layer in self.layers)  # this step and the next
        if left == 0:  # this step runs a policy run: the storage moves, and the graph may be stale after it
            fills = [layer.step_fills for layer in self.layers]
            out = self._eager(tokens, position)
            if self._graph is not None and self._same_launches():
                # The run moved tokens inside the tables and pool the graph's launches read (a run that grows
                # or shrinks none, as in a steady generation): the graph replays until the next run.
                self._replays_left = min(layer.decode_steps_before_policy() for layer in self.layers)
                self.counts["reused"] += 1
                return out
            self._graph = self._signatures = None
            # Its decode kernels ran on the storage the run left (plan built, kernels compiled, device step
            # advanced by them): the next step can be captured as it is.
            self._warm = fills == [layer.step_fills for layer in self.layers] and all(
                layer.plan_kept() for layer in self.layers
            )
            return out
        if not self._warm or left < 2:  # a graph needs a step to replay after the one it captures
            self._warm = True
            return self._eager(tokens, position)
        return self._capture(tokens, position)

    def _same_launches(self) -> bool:
        """Whether every layer's decode launches are still those the graph captured: the same plan object, made
        for the same storage tensors (held by the plan, so no id was reused)."""
        now = [layer.launch_signature() for layer in self.layers]
        return all(p is q and s == t for (p, s), (q, t) in zip(self._signatures, now, strict=True))

    def _forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=tokens, position_ids=pos, past_key_values=self.cache, use_cache=True)
        return out.logits[:, -1:].argmax(-1)

    def _eager(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        self.counts["eager"] += 1
        pos = torch.full((tokens.shape[0], 1), position, dtype=torch.long, device=tokens.device)
        return self._forward(tokens, pos)

    def _capture(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """Capture this step (its host work runs now, its launches are recorded) and run it by one replay."""
        self._tok = tokens.clone()
        self._pos = torch.full((tokens.shape[0], 1), position, dtype=torch.long, device=tokens.device)
        fills = [layer.step_fills for layer in self.layers]
        if self._pool is None:
            self._pool = self.graphs.pool()
        graph = self.graphs.new()
        with self.graphs.capture(graph, self._pool):
            self._next = self._forward(self._tok, self._pos)
        graph.replay()
        # The pool's last graph is held until the next capture: torch frees a graph's private pool with its last
        # graph, and refuses a capture into a pool no graph holds while tensors from it live (this step's tokens
        # do: CUDACachingAllocator's "use_count > 0" assert, the eleventh lease's steps-mode check).
        self._held = graph
        self.counts["captured"] += 1
        # A layer that set its device step from the host during the capture recorded those numbers: replayed,
        # they would rewind every later step. Then this graph serves this step only.
        if [layer.step_fills for layer in self.layers] == fills:
            self._graph = graph
            self._signatures = [layer.launch_signature() for layer in self.layers]
            # the steps after this one that run no policy run: the replays this graph serves
            self._replays_left = min(layer.decode_steps_before_policy() for layer in self.layers)
        return self._next.clone()

    def _step_layers(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        if self._pieces is None:
            return self._capture_layers(tokens, position)
        self._tok.copy_(tokens)
        self._pos.fill_(position)
        for piece, call in zip(self._pieces, self._calls, strict=False):
            piece.replay()
            call.run()
        self._pieces[-1].replay()
        self.counts["replayed"] += 1
        return self._next.clone()

    def _capture_layers(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """Run this step with the model's ops captured piece by piece: a piece ends where a layer's ``update()``
        starts (the piece is replayed, so its keys, values and queries hold this step's values), the cache's
        calls run eagerly, and the next piece starts once ``attend()`` returns."""
        self._tok = tokens.clone()
        self._pos = torch.full((tokens.shape[0], 1), position, dtype=torch.long, device=tokens.device)
        if self._pool is None:
            self._pool = self.graphs.pool()
        pieces: list = []
        calls: list[_CacheCall] = []
        open_capture: list = []

        def begin() -> None:
            graph = self.graphs.new()
            cm = self.graphs.capture(graph, self._pool)
            cm.__enter__()
            pieces.append(graph)
            open_capture.append(cm)

        def end() -> None:
            open_capture.pop().__exit__(None, None, None)
            pieces[-1].replay()

        def patched(layer: TriStateLayer):
            def update(key, value, *args, **kwargs):
                if calls and calls[-1].attend is None:
                    raise RuntimeError(
                        "GraphedDecoder(mode='layers'): a layer's update() came before the last one's attention; "
                        "this model's attention does not call them in pairs"
                    )
                end()
                calls.append(_CacheCall(layer, key, value, args, kwargs))
                return type(layer).update(layer, key, value, *args, **kwargs)

            def attend(module, query, key, value, mask, scaling, computed=None):
                # ``computed``: a dense layer's output from the model's own attention, left aside: the replay
                # computes it again where the next graph reads it
                call = calls[-1] if calls else None
                if call is None or call.layer is not layer or call.attend is not None:
                    raise RuntimeError("GraphedDecoder(mode='layers'): a layer's attend() without its update()")
                call.attend = (module, query, key, value, mask, scaling)
                call.out = type(layer).attend(layer, *call.attend)
                begin()
                return call.out

            return update, attend

        for layer in self.layers:
            layer.update, layer.attend = patched(layer)
        try:
            begin()
            self._next = self._forward(self._tok, self._pos)
            end()
        except BaseException:
            if open_capture:  # leave no capture open on the stream
                open_capture.pop().__exit__(*sys.exc_info())
            raise
        finally:
            for layer in self.layers:
                del layer.update, layer.attend
        if len(calls) != len(self.layers) or any(c.attend is None for c in calls):
            raise RuntimeError(
                f"GraphedDecoder(mode='layers'): a step made {len(calls)} cache calls for {len(self.layers)} layers"
            )
        self._pieces, self._calls = pieces, calls
        self.counts["captured"] += 1
        return self._next.clone()

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Prefill ``input_ids`` (no padding) eagerly, then greedy tokens: ``[B, max_new_tokens]``."""
        if max_new_tokens < 1:
            raise ValueError(f"GraphedDecoder.generate: max_new_tokens={max_new_tokens} must be >= 1")
        out = self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1:].argmax(-1)
        new = [tok]
        for i in range(max_new_tokens - 1):
            tok = self.step(tok, input_ids.shape[1] + i)
            new.append(tok)
        return torch.cat(new, dim=1)
