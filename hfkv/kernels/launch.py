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

from hfkv.kernels.environment import interpreter_on, triton_version

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
        from triton.runtime.jit import JITFunction  # optional: triton (installed on Linux x86-64 only)
    except ImportError:
        return None
    return JITFunction


def specialization(arg: Any, constexpr: bool = False) -> Any:
    """A key equal for two arguments whenever Triton would specialize them the same way (it may split finer).

    Tensors: dtype and 16-byte alignment; integers: width (i32 / i64 / u64), divisibility by 16 and equality to 1;
    floats and bools are not specialized; tuples element by element; a constexpr parameter, and anything else, by
    value. ``tests/test_kernel_launch.py`` checks it against Triton's own ``native_specialize_impl``.
    """
    if constexpr:
        return ("value", type(arg), arg)
    kind = type(arg)
    if kind is torch.Tensor or isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if kind is int:
        width = 0 if _I32[0] <= arg < _I32[1] else 1 if arg < _I64_MAX else 2
        return (int, width, arg == 1, arg % 16 == 0)
    if kind is float or kind is bool or arg is None:
        return kind
    if kind is tuple:
        return tuple(specialization(a) for a in arg)
    return ("value", kind, arg)


class _Triton:
    """Triton's runtime objects a bound launch reads, looked up once (an import statement in the hot path costs more
    than the rest of a check)."""

    def __init__(self) -> None:
        from triton import knobs  # optional: triton (installed on Linux x86-64 only)
        from triton.runtime.driver import driver  # optional: triton (installed on Linux x86-64 only)

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
    """One launch site: a kernel, its grid and its constexpr keyword arguments, called with the positional arguments.

    ``launch(*args)`` does what ``fn[grid](*args, **constants)`` does (the tests compare the launcher calls of both),
    without Triton's binding once the site is bound (the module docstring). ``bound_launches`` counts the launches
    that took the shortcut, ``triton_launches`` those that went through Triton.
    """

    __slots__ = (
        "fn", "grid", "constants", "bound_launches", "triton_launches", "_bindable", "_kernel", "_held", "_specs",
        "_tail", "_device", "_knobs", "_grid3", "_constexpr", "_tr",
    )  # fmt: skip

    def __init__(
        self, fn: Any, grid: Sequence[int], constants: dict[str, Any] | None = None, supported: bool | None = None
    ) -> None:
        """``supported``: :func:`shortcut_supported`, for a caller making several sites at once (reading the
        environment costs microseconds); None: read here."""
        self.fn = fn
        self.grid = tuple(grid)
        self.constants = dict(constants or {})
        self.bound_launches = 0
        self.triton_launches = 0
        self._grid3 = (self.grid + (1, 1))[:3]
        self._kernel = None
        self._bindable = False
        if shortcut_supported() if supported is None else supported:
            self._bindable = isinstance(fn, _jit_class())

    def __call__(self, *args: Any) -> None:
        kernel = self._kernel
        if kernel is not None:
            held, specs, constexpr = self._held, self._specs, self._constexpr
            if len(args) == len(held):
                for i, arg in enumerate(args):
                    h = held[i]
                    if arg is h or (type(h) is _REF and h() is arg):
                        continue
                    if specialization(arg, constexpr[i]) != specs[i]:
                        break
                else:
                    tr = self._tr
                    active = tr.driver.active
                    device = active.get_current_device()
                    if device == self._device and tr.knob_state() == self._knobs and not self.fn.pre_run_hooks:
                        stream = active.get_current_stream(device)
                        full = args + self._tail
                        metadata = kernel.launch_metadata(self.grid, stream, *full)
                        g0, g1, g2 = self._grid3
                        runtime = tr.runtime
                        kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, metadata,
                                   runtime.launch_enter_hook, runtime.launch_exit_hook, *full)  # fmt: skip
                        self.bound_launches += 1
                        return
        kernel = self.fn[self.grid](*args, **self.constants)
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
        self._specs = tuple(specialization(a, c) for a, c in zip(args, self._constexpr, strict=True))
        self._held = tuple(weakref.ref(a) if isinstance(a, torch.Tensor) else a for a in args)
        self._tail = tuple(tail)
        self._device = tr.driver.active.get_current_device()
        self._knobs = knobs
        self._tr = tr
        self._kernel = kernel
