"""A pytest plugin that runs the kernel tests' Triton launches on a GPU while the tests keep CPU tensors.

The kernel tests (``tests/test_kernel_decode_attention.py``, ``test_kernel_encode.py``) and the ``generate`` equality
tests (``test_backend_triton.py``) build their storage on the CPU and compare with the torch twins there, so on a
machine without a GPU they run the kernels in Triton's interpreter. To run the same tests against the *compiled*
kernels, with the same comparisons, this plugin wraps the Triton entry points (``paged_attention`` and the cache's
``run_plan``, ``encode_write``, ``move_records``, ``clear_tags``, ``compact``, ``release_pages``,
``read_meta_triton``, ``read_candidates_triton``, ``allocate_triton``, ``count_appends``, ``reserve_slots``,
``tier_changes``, ``plan_moves`` and its halves, ``gather_exits``, ``gather_decode``, ``observation_scores``,
``oq_score_triton``): a call copies the storage behind every tensor argument to the device once (views of one storage
stay views of one copy, so parts that share a pool share it there too), runs the wrapper there, and copies each
storage back, so in-place writes (pool bytes, score sums) land in the tests' tensors as if the kernel had run on them.
Returned tensors come back to the CPU. The cache's backend check lets ``backend="triton"`` run on CPU tensors for the
same reason.

    HFKV_KERNEL_DEVICE=cuda python -m pytest -p tests.gpu_offload tests/test_kernel_encode.py   # repository root

``HFKV_TEST_REPORT=<file>`` appends one JSON line per finished test phase, so a run cut short by a
time limit still says what it ran (``eval/gpu/check.py`` reads it). Without
``HFKV_KERNEL_DEVICE`` the plugin changes nothing. ``HFKV_KERNEL_DEVICE=cpu`` copies too (each call
works on fresh CPU storages), which checks the round trip itself in Triton's interpreter; set
``TRITON_INTERPRET=1`` in the environment then, since loading this plugin imports hfkv (and with it
triton) before ``tests/conftest.py`` could set it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable
from typing import Any

import torch

ENV_DEVICE = "HFKV_KERNEL_DEVICE"
ENV_REPORT = "HFKV_TEST_REPORT"
# Every Triton entry point the cache calls: one missing here would get CPU pointers on a GPU run and fail.
# The cache launches decode attention through its kept plan (run_plan), the tests through paged_attention.
WRAPPED = (
    ("hfkv.kernels.decode_attention", "paged_attention"),
    ("hfkv.kernels.decode_attention", "run_plan"),
    ("hfkv.kernels.encode", "encode_write"),
    ("hfkv.kernels.move", "move_records"),
    ("hfkv.kernels.move", "clear_tags"),
    ("hfkv.kernels.move", "compact"),
    ("hfkv.kernels.move", "release_pages"),
    ("hfkv.kernels.move", "remove_tiers"),
    ("hfkv.kernels.meta", "read_meta_triton"),
    ("hfkv.kernels.meta", "read_candidates_triton"),
    ("hfkv.kernels.allocate", "allocate_triton"),
    ("hfkv.kernels.reserve", "count_appends"),
    ("hfkv.kernels.reserve", "reserve_slots"),
    ("hfkv.kernels.changes", "tier_changes"),
    ("hfkv.kernels.moves", "plan_moves"),
    ("hfkv.kernels.moves", "launch_plan_moves"),
    ("hfkv.kernels.moves", "place_moves"),
    ("hfkv.kernels.moves", "gather_exits"),
    ("hfkv.kernels.gather", "gather_decode"),
    ("hfkv.kernels.observation", "observation_scores"),
    ("hfkv.kernels.observation", "oq_score_triton"),
)

# Offloaded calls under way: a Triton launch made while this is 0 bypassed the wrappers (an entry point
# missing from WRAPPED), which on a GPU run fails on CPU pointers; the tests check it on the CPU.
ACTIVE = [0]


class _Mover:
    """Device copies of the storages behind one call's tensors, and their way back."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.storages: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # each argument's device view by the view's id: a call that returns an argument (``out=``) gives the
        # caller's own tensor back, as it would without the offload
        self.given: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return self._tensor(x)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):  # parts, a DecodePlan
            moved = {f.name: self(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init}
            return dataclasses.replace(x, **moved)
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # a NamedTuple (the ring's PendingWrite)
            return type(x)(*(self(i) for i in x))
        if isinstance(x, (list, tuple)):
            return type(x)(self(i) for i in x)
        if isinstance(x, dict):
            return {k: self(v) for k, v in x.items()}
        return x

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        if t.device == self.device and t.device.type != "cpu":
            return t  # a target of "cpu" copies anyway: it exercises the round trip without a GPU
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self.storages:
            host = torch.empty(0, dtype=torch.uint8).set_(storage)
            self.storages[key] = (host, host.to(self.device, copy=True))
        dev = self.storages[key][1].untyped_storage()
        view = torch.empty(0, dtype=t.dtype, device=self.device).set_(dev, t.storage_offset(), t.shape, t.stride())
        self.given[id(view)] = (view, t)
        return view

    def write_back(self) -> None:
        for host, dev in self.storages.values():
            host.copy_(dev)


def _to_cpu(x: Any, given: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Any:
    if isinstance(x, torch.Tensor):
        view, host = given.get(id(x), (None, None))
        return host if view is x else x.cpu()  # an argument returned: the caller's tensor (written back)
    if isinstance(x, tuple):
        return tuple(_to_cpu(i, given) for i in x)
    return x


def offloaded(fn: Callable, device: torch.device | str) -> Callable:
    """``fn`` run on ``device`` for CPU tensor arguments, its in-place writes copied back (module docstring)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())

    @functools.wraps(fn)
    def call(*args, **kwargs):
        mover = _Mover(device)
        ACTIVE[0] += 1
        try:
            out = fn(*mover(args), **mover(kwargs))
        finally:
            ACTIVE[0] -= 1
        mover.write_back()
        return _to_cpu(out, mover.given)

    call.__wrapped_for_device__ = device  # type: ignore[attr-defined]
    return call


def install(device: torch.device | str) -> list[str]:
    """Route the Triton entry points and the cache's backend check through ``device``; what was wrapped."""
    import importlib

    import hfkv.layer.layer

    done = []
    for module_name, name in WRAPPED:
        module = importlib.import_module(module_name)
        fn = getattr(module, name)
        if not hasattr(fn, "__wrapped_for_device__"):
            setattr(module, name, offloaded(fn, device))
            done.append(f"{module_name}.{name}")
    resolve = hfkv.layer.layer.resolve_backend  # where a layer resolves its backend
    if not hasattr(resolve, "__wrapped_for_device__"):

        def resolve_on_cpu(requested: str, dev: torch.device | str) -> str:
            if requested == "triton" and torch.device(dev).type == "cpu":
                return "triton"  # the launches go to the device through the wrappers above
            return resolve(requested, dev)

        resolve_on_cpu.__wrapped_for_device__ = device  # type: ignore[attr-defined]
        hfkv.layer.layer.resolve_backend = resolve_on_cpu
        done.append("hfkv.layer.layer.resolve_backend")
    return done


# ---------------------------------------------------------------------------------------------- pytest
_INSTALLED: list[str] = []


def pytest_configure(config) -> None:
    device = os.environ.get(ENV_DEVICE)
    if device:
        _INSTALLED[:] = install(device)


def pytest_report_header(config) -> str | None:
    device = os.environ.get(ENV_DEVICE)
    if not device:
        return None
    return f"tests.gpu_offload: Triton launches run on {device} ({', '.join(_INSTALLED)})"


def pytest_collection_finish(session) -> None:
    """The selected tests, once (the first xdist worker, or the only process): a run stopped at its deadline can
    then say which did not run, not only how many did."""
    path = os.environ.get(ENV_REPORT)
    if not path or os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"collected": [item.nodeid for item in session.items]}) + "\n")


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get(ENV_REPORT)
    if not path or (report.when != "call" and report.passed):
        return
    row = {"test": report.nodeid, "when": report.when, "outcome": report.outcome, "seconds": round(report.duration, 3)}
    if report.failed:
        row["message"] = report.longreprtext[-3000:]
    elif report.skipped and isinstance(report.longrepr, tuple):
        row["message"] = str(report.longrepr[2])[:300]
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")
