"""Decode steps of a TriStateCache replayed from CUDA graphs, between policy runs.

On a GPU a decode step of an 8B model is bound by its host: transformers' Python and a few hundred
launches take ~25-35 ms where the bytes take ~5-10 (docs/kernels.md, "Tenth lease"), for DynamicCache and
hfkv alike. A CUDA graph removes the host from a step, but only where every launch of the step is the
same from one step to the next. Between two policy runs a TriStateCache's step is: its storage does not
move, the decode kernels read the step's position and ring slot from the device
(``run_plan(step=...)``), and the host knows how many steps are left before the next policy run
(``TriStateLayer.decode_steps_before_policy``). DynamicCache's step cannot be (its tensors grow every step).

:class:`GraphedDecoder` runs greedy one-token steps: the step that runs a policy run eagerly (its decode
kernels run on the storage the run leaves: the new launch plan is built, what is new compiled), the next
one captured into a graph, and every later step until the next policy run replayed
from it, with the host's bookkeeping (``TriStateLayer.replayed_step``) in place of ``update()`` and
``attend()``. A policy run moves tokens inside the layer's page tables and pool; where it grows or shrinks
none of them (``TriStateLayer.launch_signature``: the same launch plan, for the same tensors), the graph still
holds and replays the steps up to the next run, so once the tables stop growing seven steps of eight are
replays at the default interval of 8, and nothing is captured again. (The first decode step, and a step
after one whose storage changed after its attention, run eagerly before a capture.)

    decoder = GraphedDecoder(model, cache)
    tokens = decoder.generate(input_ids, max_new_tokens=256)     # greedy; [batch, max_new_tokens]
"""

from __future__ import annotations

import torch

from hfkv.cache import TriStateCache, TriStateLayer


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


class GraphedDecoder:
    """Greedy decoding of ``model`` with ``cache``, its steps between policy runs replayed from a CUDA graph.

    Needs every layer compressed (a TriStateLayer on the Triton backend: an uncompressed sliding layer
    grows like DynamicCache's) and a CUDA device. ``counts`` says how many steps ran eagerly, were captured
    and were replayed, and after how many policy runs the graph was reused. Step the cache through the
    decoder only: what it replays was counted at the capture.
    """

    def __init__(self, model: torch.nn.Module, cache: TriStateCache, graphs=None) -> None:
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
        self._warm = False  # an eager step ran on the storage as it is now (plan built, kernels compiled)
        self._tok = self._pos = self._next = None

    def _check_ready(self, tokens: torch.Tensor) -> None:
        if self.graphs.requires_cuda and tokens.device.type != "cuda":
            raise ValueError(f"GraphedDecoder: CUDA graphs need a CUDA device; tokens are on {tokens.device}")
        if not all(layer.is_initialized for layer in self.layers):
            raise ValueError("GraphedDecoder: prefill the cache first (generate() does)")
        if self.cache.backend != "triton":
            raise ValueError(
                f"GraphedDecoder: the cache's backend is {self.cache.backend!r}; graphs replay the Triton decode "
                "kernels (backend='triton', or 'auto' on CUDA)"
            )

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """One token per row (``tokens [B, 1]``) at logical ``position``; the next greedy tokens ``[B, 1]``."""
        if self._next is None:
            self._check_ready(tokens)
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
        self.counts["captured"] += 1
        # A layer that set its device step from the host during the capture recorded those numbers: replayed,
        # they would rewind every later step. Then this graph serves this step only.
        if [layer.step_fills for layer in self.layers] == fills:
            self._graph = graph
            self._signatures = [layer.launch_signature() for layer in self.layers]
            # the steps after this one that run no policy run: the replays this graph serves
            self._replays_left = min(layer.decode_steps_before_policy() for layer in self.layers)
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
