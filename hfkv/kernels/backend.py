"""Which path a layer's attention, storage and policy runs take: the Triton kernels, the C++ CPU kernels or the
torch twins — one table of operations per backend, and the only module that compares a backend's name.

The choice is made once per layer, from the device its first tensors arrive on, so ``auto`` does
the right thing for a model on a GPU and for the same code on a laptop: Triton on CUDA tensors, the
C++ kernels (:mod:`hfkv.kernels.cpu`, built on first use) on CPU tensors, and the torch twins on a
CPU where no C++ compiler can build them. :func:`backend_ops` then gives the layer and its storage
the backend's :class:`BackendOps`; they call its entries and read its flags, never the name
(docs/architecture.md, "Backends").
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from hfkv.kernels.cpu.build import library
from hfkv.kernels.environment import cpu_kernel_available, interpreter_on, triton_available
from hfkv.policy.oq import oq_score_from_mass
from hfkv.policy.scores import score_means

BACKENDS: tuple[str, ...] = ("auto", "torch", "triton", "cpu")


def resolve_backend(requested: str, device: torch.device | str) -> str:
    """``auto``: triton on CUDA tensors (when triton is installed), the CPU kernel on CPU tensors (when it
    builds), torch elsewhere; ``triton`` and ``cpu``: checked."""
    device = torch.device(device)
    if requested not in BACKENDS:
        raise ValueError(f"TriStateConfig.backend={requested!r} is not a backend; allowed: {BACKENDS}")
    if requested == "torch":
        return "torch"
    if requested == "auto":
        if device.type == "cuda" and triton_available():
            return "triton"
        return "cpu" if device.type == "cpu" and cpu_kernel_available() else "torch"
    if requested == "cpu":
        if device.type != "cpu":
            raise ValueError(
                f"TriStateConfig.backend='cpu' runs on CPU tensors, but this cache's tensors are on "
                f"{device.type!r}; use backend='auto' (Triton on CUDA) or 'torch'"
            )

        library()  # raises CpuKernelUnavailable, naming the compiler and its error
        return "cpu"
    if not triton_available():
        raise ValueError(
            "TriStateConfig.backend='triton' needs the triton package (pip install triton), which is not "
            "installed; use backend='torch' or 'auto'"
        )
    if device.type != "cuda" and interpreter_on() and _compiled_kernels_loaded():
        raise ValueError(
            "TriStateConfig.backend='triton' on a CPU tensor: TRITON_INTERPRET=1 is set, but hfkv's kernels were "
            "imported before it was, as GPU kernels. Set TRITON_INTERPRET=1 before importing hfkv (e.g. in the "
            "shell), or use backend='torch'."
        )
    if device.type != "cuda" and not interpreter_on():
        raise ValueError(
            f"TriStateConfig.backend='triton' runs on CUDA tensors, but this cache's tensors are on "
            f"{device.type!r}. Move the model to a GPU, use backend='auto' or 'torch', or set "
            "TRITON_INTERPRET=1 before importing hfkv to run the kernels in Triton's CPU interpreter "
            "(slow; meant for tests)."
        )
    return "triton"


def _compiled_kernels_loaded() -> bool:
    """Whether the decode kernels were already decorated as GPU kernels (the variable came too late)."""
    module = sys.modules.get("hfkv.kernels.decode_attention")
    if module is None:
        return False
    return type(module._partial_kernel).__name__ != "InterpretedFunction"


@dataclass(frozen=True)
class BackendOps:
    """One backend's operations, resolved when a layer is built (its first tensors' device).

    An entry that is None has no kernel on this backend: the caller's own torch code is the twin (the
    storage's gathers and scatters, the policy's probabilities), which is what the torch backend runs
    everywhere. Entries are looked up in their modules when the table is made, so a wrapper installed
    on a kernel module's function before a cache is built (tests/gpu_offload.py) is what the layer calls.
    """

    name: str
    # -- storage (hfkv.storage.paged): records encoded, reserved, compacted, read and gathered
    encode_write: Callable | None = None  # (pool, offsets, layout, k, v, pos, score) -> None
    count_appends: Callable | None = None  # (b, h, counts, tpp, pages) -> (k, old, total, widest)
    reserve_slots: Callable | None = None  # (pool, table, old, k, ids, tpp, stride, n[, counts]) -> offsets
    compact: Callable | None = None  # (pool, table, counts, keep, tpp, layout) -> new counts
    release_pages: Callable | None = None  # (table, counts, new, tpp, free_stack, n_free, pages) -> (freed, width)
    remove_tiers: Callable | None = None  # every tier's removal in one compaction (Triton)
    read_meta: Callable | None = None  # (pool, table, counts, tpp, layout, m) -> (pos, score, valid)
    read_candidates: Callable | None = None  # (pool, tables, ..., mean_over) -> (pos, mean score, valid, state)
    gather_decode: Callable | None = None  # (pool, table, tpp, layout, b, h, s[, (source, tier), out])
    # -- the policy run (hfkv.layer.policy_runner)
    allocate: Callable | None = None  # hfkv.policy.budget.allocate's arguments, and over= (some row does not fit)
    tier_changes: Callable | None = None  # (new, valid, sizes) -> per tier (demoted in, leaving)
    observation_scores: Callable | None = None  # (query, key, scaling, window, reduction) -> (sums, mass)
    oq_score_from_mass: Callable | None = None  # (mass, considered, tau) -> [B]
    # -- attention (hfkv.layer.reads): the paged decode kernel, None on the torch backend
    decode: Any = None  # PagedDecode
    # -- what the backend does beyond its entries
    reserve_sets_counts: bool = False  # given a planned run's pages and heads, reserve_slots sets the counts
    plans_moves: bool = False  # a policy run's moves are planned on the device (hfkv.kernels.moves)
    deferred_window_write: bool = False  # the decode kernel writes the step's token into the ring
    graph_steps: bool = False  # decode steps launch alike, so a CUDA graph replays them (hfkv.graphs)
    traced_steps: bool = False  # Dynamo traces a decode step between policy runs (hfkv.compiled): torch ops, operators

    def __deepcopy__(self, memo: dict) -> BackendOps:
        return self  # a table of functions and modules: shared by copies of a storage or cache, never copied


@dataclass(frozen=True)
class PagedDecode:
    """The paged decode kernel of one backend: a launch plan per storage, then runs of it.

    ``module`` is looked up at every call (not its functions once), so the GPU offload plugin's wrappers,
    installed on the module's functions, are what a step calls.
    """

    module: ModuleType
    triton: bool  # Triton's plan/run (a deferred ring write, query tiles); else the CPU kernel's

    @property
    def plan_type(self) -> type:
        return self.module.DecodePlan if self.triton else self.module.CpuPlan

    def plan(self, query, parts, pad_end, reduction: str, window_write: bool, add_scores: bool = True):
        """``add_scores=False``: the slots' score fields are left as they are (they hold learned values)."""
        if self.triton:
            return self.module.plan_attention(
                query, parts, pad_end, reduction, add_scores, return_delta=False, window_write=window_write
            )
        return self.module.plan_cpu(query, parts, add_scores)  # the CPU kernel's parts described once per storage

    def run(self, plan, query, parts, q_start: int, pad_end, scaling: float, reduction: str, write, step, out):
        """A step on ``plan`` (which says whether it adds scores)."""
        if self.triton:
            return self.module.run_plan(
                plan, query, q_start, pad_end, scaling, write, checked=False, step=step, out=out
            )[0]
        return self.module.paged_attention_cpu(
            query, parts, q_start, pad_end, scaling, reduction, return_delta=False, plan=plan, checked=False
        )[0]

    def tile(self, query: torch.Tensor, parts) -> int | None:
        """Queries per call that keep a Triton call's logits under ``CHUNK_LOGITS_BYTES``; None: no tiling."""
        if not self.triton:
            return None
        bsz, hq = query.shape[:2]
        per_query = 4 * bsz * hq * sum(p.slots for p in parts)  # g query rows per KV head: hq rows per query
        return max(1, CHUNK_LOGITS_BYTES // max(1, per_query))

    def traced(self, query, parts, q_start: int, pad_end, scaling: float, reduction: str) -> torch.Tensor:
        """One call Dynamo can trace (a step under torch.compile): the CPU kernel's operator."""
        if self.triton:
            raise NotImplementedError("the Triton decode kernel is not traced yet: its steps run eagerly")
        return self.module.paged_attention_traced(query, parts, q_start, pad_end, scaling, reduction)

    def attention(
        self, query, parts, q_start: int, pad_end, scaling: float, reduction: str, add_scores: bool = True
    ) -> torch.Tensor:
        """One unplanned call (a query tile's)."""
        return self.module.paged_attention(
            query, parts, q_start, pad_end, scaling, reduction, add_scores, return_delta=False
        )[0]


# The Triton partial pass keeps a call's logits (4 bytes per query row and slot) for its score pass: one
# 4,096-token chunk over 6,000 slots at batch 8 and 8 KV heads x 4 would hold 25 GB (a chunked 32k prefill
# of Llama-3.1-8B ran out of memory at a third of the batch its cache would fit). Larger calls go through
# in query tiles that keep the logits under this.
CHUNK_LOGITS_BYTES = 256 * 2**20


def backend_ops(name: str) -> BackendOps:
    """The table of a resolved backend (``torch``, ``cpu`` or ``triton``; :func:`resolve_backend`'s result).

    The kernel modules are imported here, at a layer's first tensors: the Triton ones import triton (an
    optional dependency), the CPU ones build their C++ library on first use.
    """
    if name == "torch":
        # deferred: hfkv.kernels.changes imports triton (optional)
        from hfkv.kernels.changes import tier_changes_reference
        from hfkv.policy.budget import allocate  # deferred: each branch binds its own allocate

        return BackendOps(
            "torch", allocate=_ignoring_over(allocate), tier_changes=tier_changes_reference, traced_steps=True
        )
    if name == "cpu":
        # deferred: loaded with the cpu backend (and its own allocate)
        from hfkv.kernels.cpu import allocate, compact, encode, gather, meta, observation, reserve

        return BackendOps(
            "cpu",
            encode_write=_unchecked(encode.encode_write_cpu),  # slots it was given were just reserved
            count_appends=reserve.count_appends_cpu,
            reserve_slots=reserve.reserve_slots_cpu,
            compact=compact.compact_cpu,
            release_pages=compact.release_pages_cpu,
            read_meta=meta.read_meta_cpu,
            read_candidates=_means_after(meta.read_candidates_cpu),
            gather_decode=gather.gather_decode_cpu,
            allocate=_ignoring_over(allocate.allocate_cpu),  # the same decisions, selected in C++
            tier_changes=meta.tier_changes_cpu,
            observation_scores=observation.observation_scores_cpu,  # the same logits, then one C++ pass
            oq_score_from_mass=oq_score_from_mass,
            decode=PagedDecode(importlib.import_module("hfkv.kernels.cpu.paged_decode"), triton=False),
            traced_steps=True,  # the kernel is also the operator hfkv::paged_attention_cpu
        )
    if name == "triton":  # triton is an optional dependency: imported only for a layer that runs on it
        # optional: these kernels import triton
        from hfkv.kernels import allocate, changes, encode, gather, meta, move, observation, reserve

        return BackendOps(
            "triton",
            encode_write=encode.encode_write,
            count_appends=reserve.count_appends,
            reserve_slots=reserve.reserve_slots,
            compact=move.compact,
            release_pages=move.release_pages,
            remove_tiers=move.remove_tiers,
            read_meta=meta.read_meta_triton,
            read_candidates=meta.read_candidates_triton,
            gather_decode=gather.gather_decode,
            allocate=_fast_path_unless_over(allocate.allocate_triton),  # three launches around the sort
            tier_changes=changes.tier_changes,
            observation_scores=observation.observation_scores,
            oq_score_from_mass=observation.oq_score_triton,
            decode=PagedDecode(importlib.import_module("hfkv.kernels.decode_attention"), triton=True),
            reserve_sets_counts=True,
            plans_moves=True,
            deferred_window_write=True,
            graph_steps=True,
        )
    raise ValueError(f"backend_ops: {name!r} is not a resolved backend; allowed: torch, cpu, triton")


def _ignoring_over(fn: Callable) -> Callable:
    def allocate(*args, over: bool = False):
        return fn(*args)

    return allocate


def _fast_path_unless_over(fn: Callable) -> Callable:
    def allocate(*args, over: bool = False):
        # a row known not to fit: the allocation need not read back whether everything fits
        return fn(*args, fast_path=not over)

    return allocate


def _unchecked(fn: Callable) -> Callable:
    def encode_write(*args):
        return fn(*args, checked=False)

    return encode_write


def _means_after(fn: Callable) -> Callable:
    """The C++ candidates' score sums as the policy's means (the Triton kernel takes the means itself)."""

    def read_candidates(*args):
        *args, mean_over = args
        pos, score, valid, state = fn(*args)
        return pos, score_means(score, pos, mean_over), valid, state

    return read_candidates
