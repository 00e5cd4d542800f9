"""Triton launches that skip Triton's per-call binding while a launch site's arguments keep their specialization.

``kernel[grid](*args)`` binds the call's arguments, specializes each one (a tensor's dtype and 16-byte alignment, an
integer's width, divisibility by 16 and equality to 1), builds the compiled kernel's cache key and looks it up before
the driver's launcher runs: ~20 us for the decode pass's 48 arguments and ~33 us for a layer's three decode launches
on this project's CPU (``eval/launch_binding.py``), more than all of hfkv's own Python in a layer's step. A decode plan
launches the same three kernels with the same grid, constexprs and storage tensors at every step until its layer's
next policy run; only the query, the window's new key and value and the output are new tensors.

So :class:`KernelLaunch` makes its first call through Triton, which compiles or finds the kernel and launches it, and
keeps the compiled kernel and the arguments' specializations. A later call whose every argument is the same object as
then, or specializes the same way, calls the kernel's launcher directly, exactly as ``JITFunction.run`` does: the
current device's current stream, ``launch_metadata``, Triton's launch hooks, and every parameter's value in the
signature's order. Anything else — an argument specialized differently, another current device, Triton's debug or
instrumentation knobs changed, a pre-run hook — goes through Triton again, which rebinds the site.

Not repeated: Triton's check, at each of its launches, that the module globals a kernel read when it was compiled
still hold their values (hfkv's kernels read constants that never change; a site's first call, through Triton,
makes the check).

Only for compiled kernels (``JITFunction``) of the Triton versions whose launch protocol this follows (3.4 up to 4);
the interpreter and other versions always launch through Triton. ``HFKV_TRITON_BINDING=1`` turns the shortcut off
(read when a site is made). A tensor argument is recognised as the same object through a weak reference, so a site
keeps no step's query or output alive (tuple arguments, the plan's part pointers, are held as they are: the plan holds
them anyway); a tensor whose storage is swapped in place (``Tensor.set_``) keeps its dtype but could change alignment,
and hfkv does not do that to the tensors it launches with.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from hfkv.kernels.backend import interpreter_on, triton_version

ENV_TRITON_BINDING = "HFKV_TRITON_BINDING"
_I32 = (-(2**31), 2**31)
_I64_MAX = 2**63
_REF = weakref.ref


def shortcut_supported() -> bool:
    """Whether this process's Triton launches the way :class:`KernelLaunch` repeats (``JITFunction.run`` of 3.4 up
    to 4: ``kernel.run(grid..., stream, function, packed_metadata, launch_metadata, hooks, *bound args)``)."""
    if interpreter_on() or os.environ.get(ENV_TRITON_BINDING, "0") == "1":
        return False
    return _jit_class() is not None


@functools.cache
def _jit_class() -> type | None:
    """Triton's ``JITFunction`` where its version is one :class:`KernelLaunch` follows, else None (looked up once: a
    policy run makes a plan, and with it six sites, for every layer)."""
    try:
        if not (3, 4) <= triton_version() < (4, 0):
            return None
        from triton.runtime.jit import JITFunction
    except ImportError:
        return None
    return JITFunction


def specialization(arg: Any, constexpr: bool = False, specialize: bool = True) -> Any:
    """A key equal for two arguments whenever Triton would specialize them the same way (it may split finer).

    Tensors: dtype and 16-byte alignment; integers: width (i32 / i64 / u64), divisibility by 16 and equality to 1
    (the width alone for a parameter in the kernel's ``do_not_specialize``: ``specialize=False``); floats and bools
    are not specialized; tuples element by element; a constexpr parameter, and anything else, by value.
    ``tests/test_kernel_launch.py`` checks it against Triton's own ``native_specialize_impl``.
    """
    if constexpr:
        return ("value", type(arg), arg)
    kind = type(arg)
    if kind is torch.Tensor or isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if kind is int:
        width = 0 if _I32[0] <= arg < _I32[1] else 1 if arg < _I64_MAX else 2
        return (int, width, arg == 1, arg % 16 == 0) if specialize else (int, width)
    if kind is float or kind is bool or arg is None:
        return kind
    if kind is tuple:
        return tuple(specialization(a) for a in arg)
    return ("value", kind, arg)


class _Triton:
    """Triton's runtime objects a bound launch reads, looked up once (an import statement in the hot path costs more
    than the rest of a check)."""

    def __init__(self) -> None:
        from triton import knobs
        from triton.runtime.driver import driver

        self.driver, self.runtime, self.compilation = driver, knobs.runtime, knobs.compilation
        # the compile options JITFunction.run adds from the knobs, by version
        self.fpsan = hasattr(type(knobs.compilation), "fpsan_homomorphic_casts")
        self.stages = hasattr(type(knobs.runtime), "add_stages_inspection_hook")

    def knob_state(self) -> tuple:
        """The knobs that enter a launch's compile options, read at each launch (a site rebinds when one changes),
        and the hook that adds a custom pipeline to the cache key (a site never binds while it is set)."""
        runtime, compilation = self.runtime, self.compilation
        return (
            runtime.debug,
            compilation.instrumentation_mode,
            compilation.fpsan_homomorphic_casts if self.fpsan else None,
            runtime.add_stages_inspection_hook if self.stages else None,
        )


@functools.cache
def _triton() -> _Triton:
    return _Triton()


class KernelLaunch:
    """One launch site: a kernel, its constexpr keyword arguments (and launch options) and, for ``site(*args)``, its
    grid; ``site.at(grid, *args)`` launches on a grid given per call (a grid is no part of a compiled kernel's key).

    ``site(*args)`` does what ``fn[grid](*args, **constants)`` does (the tests compare the launcher calls of both),
    without Triton's binding once the site is bound (the module docstring). ``bound_launches`` counts the launches
    that took the shortcut, ``triton_launches`` those that went through Triton. ``hold_tuples``: a tuple argument is
    held as it is, so the same tuple again is recognised without a key (a decode plan's part pointers, which the plan
    holds anyway); False for a site that outlives its arguments' owners (:func:`launch`'s shared sites).
    """

    __slots__ = (
        "fn", "grid", "constants", "bound_launches", "triton_launches", "_bindable", "_kernel", "_held", "_specs",
        "_tail", "_device", "_knobs", "_grid3", "_constexpr", "_specialize", "_tr", "_hold_tuples",
    )  # fmt: skip

    def __init__(
        self,
        fn: Any,
        grid: Sequence[int] | None,
        constants: dict[str, Any] | None = None,
        supported: bool | None = None,
        hold_tuples: bool = True,
    ) -> None:
        """``supported``: :func:`shortcut_supported`, for a caller making several sites at once (reading the
        environment costs microseconds); None: read here. ``grid`` None: a site launched by :meth:`at` only."""
        self.fn = fn
        self.grid = None if grid is None else tuple(grid)
        self.constants = dict(constants or {})
        self.bound_launches = 0
        self.triton_launches = 0
        self._grid3 = None if grid is None else (self.grid + (1, 1))[:3]
        self._kernel = None
        self._bindable = False
        self._hold_tuples = hold_tuples
        if shortcut_supported() if supported is None else supported:
            self._bindable = isinstance(fn, _jit_class())

    def __call__(self, *args: Any) -> None:
        self._launch(self.grid, self._grid3, args)

    def at(self, grid: tuple[int, ...], *args: Any) -> None:
        """Launch on ``grid`` (a tuple of one to three ints)."""
        self._launch(grid, (grid + (1, 1))[:3], args)

    def _launch(self, grid: tuple[int, ...], grid3: tuple[int, ...], args: tuple) -> None:
        kernel = self._kernel
        if kernel is not None:
            held, specs, constexpr, specialize = self._held, self._specs, self._constexpr, self._specialize
            if len(args) == len(held):
                for i, arg in enumerate(args):
                    h = held[i]
                    if arg is h or (type(h) is _REF and h() is arg):
                        continue
                    if specialization(arg, constexpr[i], specialize[i]) != specs[i]:
                        break
                else:
                    tr = self._tr
                    active = tr.driver.active
                    device = active.get_current_device()
                    if device == self._device and tr.knob_state() == self._knobs and not self.fn.pre_run_hooks:
                        stream = active.get_current_stream(device)
                        full = args + self._tail
                        metadata = kernel.launch_metadata(grid, stream, *full)
                        g0, g1, g2 = grid3
                        runtime = tr.runtime
                        kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, metadata,
                                   runtime.launch_enter_hook, runtime.launch_exit_hook, *full)  # fmt: skip
                        self.bound_launches += 1
                        return
        kernel = self.fn[grid](*args, **self.constants)
        self.triton_launches += 1
        if self._bindable:
            self._bind(kernel, args)

    def _bind(self, kernel: Any, args: tuple) -> None:
        """Keep the kernel Triton just launched, and what its arguments were, for the next calls."""
        self._kernel = None
        if kernel is None or hasattr(kernel, "result") or self.fn.pre_run_hooks:  # not compiled yet, or hooked
            return
        tr = _triton()
        knobs = tr.knob_state()
        if knobs[-1] is not None:
            return
        params = self.fn.params
        if len(args) > len(params):
            return
        tail = []
        for p in params[len(args) :]:  # as JITFunction.run's binder fills them: keyword, else the default
            if p.name in self.constants:
                tail.append(self.constants[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                return
        self._constexpr = tuple(p.is_constexpr for p in params[: len(args)])
        self._specialize = tuple(not p.do_not_specialize for p in params[: len(args)])
        self._specs = tuple(
            specialization(a, c, sp) for a, c, sp in zip(args, self._constexpr, self._specialize, strict=True)
        )
        self._held = tuple(self._holding(a) for a in args)
        self._tail = tuple(tail)
        self._device = tr.driver.active.get_current_device()
        self._knobs = knobs
        self._tr = tr
        self._kernel = kernel

    def forget_arguments(self) -> None:
        """Compare every argument by key at the next calls, as a call with new tensors and tuples is (a measurement's
        way of timing a shared site on one recorded call, eval/launch_binding.py)."""
        if self._kernel is not None:
            self._held = (_UNHELD,) * len(self._held)

    def _holding(self, arg: Any) -> Any:
        """What is kept of an argument to recognise it as the same object next time: a weak reference for a tensor,
        the value for the rest, nothing for a tuple unless the site holds tuples (:data:`_UNHELD` matches no argument,
        so such an argument is compared by its key)."""
        if isinstance(arg, torch.Tensor):
            return weakref.ref(arg)
        if type(arg) is tuple and not self._hold_tuples:
            return _UNHELD
        return arg


_UNHELD = object()
_SITES: dict[tuple, KernelLaunch] = {}


def launch(fn: Any, grid: tuple[int, ...], *args: Any, **constants: Any) -> None:
    """``fn[grid](*args, **constants)``, through a site shared by every launch of ``fn`` with these constants (in this
    order) in the process: a policy run's and a prompt's kernels launch with new tensors, sizes and grids each time,
    which a site checks by key (:func:`specialization`) for a fraction of Triton's binding.

    Whether a shared site may skip Triton's binding (:func:`shortcut_supported`) is read when the site is made: at the
    kernel's first launch with these constants, or after :func:`forget_sites`."""
    try:
        site = _SITES.get((fn, *constants.items()))
    except TypeError:  # an unhashable constant: no site
        fn[grid](*args, **constants)
        return
    if site is None:
        site = _SITES[(fn, *constants.items())] = KernelLaunch(fn, None, constants, hold_tuples=False)
    site.at(grid, *args)


def forget_sites() -> None:
    """Drop :func:`launch`'s shared sites (their next launches go through Triton and bind again): for a caller that
    changes ``HFKV_TRITON_BINDING`` or captures Triton's launches by patching ``JITFunction.run``."""
    _SITES.clear()


def shared_sites() -> dict[tuple, KernelLaunch]:
    """:func:`launch`'s sites by ``(kernel, *constants)``, for counting and timing."""
    return dict(_SITES)
