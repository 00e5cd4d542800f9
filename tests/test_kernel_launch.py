"""hfkv.kernels.launch: a bound launch site calls the kernel's launcher exactly as Triton's own ``JITFunction.run``.

No GPU here, so the reference is Triton itself with a stand-in driver (a CUDA sm_90 target, device and stream numbers)
and a stand-in for the compiled kernel (its ``run`` records the launcher call): the same ``JITFunction`` is launched
through :class:`KernelLaunch` and through ``fn[grid](...)``, and the launcher calls must be equal argument for
argument. ``gpu_check`` compares the two on a device's real launcher.
"""

from __future__ import annotations

import gc

import pytest
import torch
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction, native_specialize_impl

from hfkv.kernels import launch as kl
from hfkv.kernels.launch import KernelLaunch, specialization


def _toy(x_ptr, y_ptr, n, scale, parts, flag, BLOCK: tl.constexpr, MODE: tl.constexpr = 3):  # noqa: N803
    pass  # never compiled: the stand-in compile below


class _Kernel:
    """A compiled kernel as JITFunction.run sees it; ``run`` is its launcher."""

    def __init__(self, key, calls):
        self.key, self.calls = key, calls
        self.function, self.packed_metadata = object(), ("packed", key)

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid, stream, len(args))

    def run(self, *args):
        self.calls.append(args)


class _Driver:
    def __init__(self):
        self.device = 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return 1000 + device


@pytest.fixture
def fake(monkeypatch):
    """A JITFunction of ``_toy`` on a stand-in CUDA driver; ``compiled`` lists its compilations."""
    monkeypatch.delenv(kl.ENV_TRITON_BINDING, raising=False)
    monkeypatch.setattr(kl, "interpreter_on", lambda: False)  # the JITFunction below is compiled code either way
    drv, previous = _Driver(), driver._active
    driver.set_active(drv)
    calls: list[tuple] = []
    compiled: list[str] = []
    try:
        yield _stand_in(_toy, monkeypatch, calls, compiled), drv, calls, compiled
    finally:
        driver.set_active(previous)


def _stand_in(fn, monkeypatch, calls: list, compiled: list) -> JITFunction:
    """``fn`` as compiled code whose compilation makes a :class:`_Kernel` recording into ``calls``."""
    jit = JITFunction(fn)

    def compile_(key, signature, device, constexprs, options, attrs, warmup):
        compiled.append(key)
        kernel = _Kernel(key, calls)
        jit.device_caches[device][0][key] = kernel
        return kernel

    monkeypatch.setattr(jit, "_do_compile", compile_)
    return jit


def _same(a, b) -> bool:
    """Launcher calls equal argument for argument: the same objects, or equal plain values."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if x is not y:
                return False
        elif isinstance(x, tuple) and isinstance(y, tuple):
            if not _same(x, y):
                return False
        elif x is not y and (type(x) is not type(y) or x != y):
            return False
    return True


GRID = (6, 2)
CONSTANTS = {"BLOCK": 64, "num_warps": 4}


def _args(x=None, y=None, n=4096, flag=True, parts=None):
    x = torch.zeros(64, dtype=torch.bfloat16) if x is None else x
    y = torch.zeros(32, dtype=torch.float32) if y is None else y
    parts = (torch.zeros(8, dtype=torch.int64), 5) if parts is None else parts
    return (x, y, n, 0.125, parts, flag)


def _both(site, jit, calls, args):
    """The launcher call the site makes for ``args``, and the one Triton's own launch makes."""
    site(*args)
    ours = calls[-1]
    jit[GRID](*args, **CONSTANTS)
    return ours, calls[-1]


def test_bound_launches_call_the_launcher_as_triton_does(fake):
    jit, _, calls, compiled = fake
    site = KernelLaunch(jit, GRID, CONSTANTS)
    parts = (torch.zeros(8, dtype=torch.int64), 5)
    y = torch.zeros(32)
    for step in range(4):  # new x each step (the query), the same y and parts (the plan's)
        ours, triton_s = _both(site, jit, calls, _args(y=y, parts=parts))
        assert _same(ours, triton_s), step
        assert ours[:4] == (6, 2, 1, 1000) and ours[-2:] == (64, 3)  # grid, stream, then BLOCK and MODE's default
    assert (site.triton_launches, site.bound_launches) == (1, 3)
    assert len(compiled) == 1


@pytest.mark.parametrize(
    "change",
    ["misaligned", "dtype", "int_one", "int_16", "int_wide", "tuple_member", "device", "debug_knob", "pre_run_hook"],
)
def test_any_change_of_specialization_or_state_goes_through_triton_again(fake, monkeypatch, change):
    jit, drv, calls, compiled = fake
    site = KernelLaunch(jit, GRID, CONSTANTS)
    base = torch.zeros(80, dtype=torch.bfloat16)
    site(*_args(x=base[:64]))
    site(*_args(x=base[16:]))  # another tensor, same dtype and alignment: bound
    assert (site.triton_launches, site.bound_launches) == (1, 1)
    args = _args(x=base[8:])
    if change == "misaligned":
        args = _args(x=base[1:])
    elif change == "dtype":
        args = _args(x=torch.zeros(64, dtype=torch.float16))
    elif change == "int_one":
        args = _args(n=1)
    elif change == "int_16":
        args = _args(n=4097)
    elif change == "int_wide":
        args = _args(n=2**31 + 16)
    elif change == "tuple_member":
        args = _args(parts=(torch.zeros(8, dtype=torch.int64), 16))
    elif change == "device":
        drv.device = 1
    elif change == "debug_knob":
        monkeypatch.setattr(knobs.runtime, "debug", True)
    elif change == "pre_run_hook":
        seen = []
        jit.add_pre_run_hook(lambda *a, **k: seen.append(1))
    ours, triton_s = _both(site, jit, calls, args)
    assert _same(ours, triton_s)
    assert site.triton_launches == 2 and site.bound_launches == 1  # rebound through Triton
    if change not in ("pre_run_hook",):
        assert len(compiled) == 2  # Triton itself compiled another kernel: the specialization did differ
        site(*args)  # and the site is bound to it now
        assert site.bound_launches == 2 and calls[-1][4] is calls[-2][4]
    else:
        assert seen and site._kernel is None  # a hooked kernel is never bound


def test_interpreter_or_the_opt_out_launch_through_triton(fake, monkeypatch):
    jit, _, calls, _ = fake
    monkeypatch.setenv(kl.ENV_TRITON_BINDING, "1")
    site = KernelLaunch(jit, GRID, CONSTANTS)
    for _ in range(3):
        site(*_args())
    assert (site.triton_launches, site.bound_launches) == (3, 0) and len(calls) == 3
    monkeypatch.delenv(kl.ENV_TRITON_BINDING)
    assert kl.shortcut_supported()
    monkeypatch.setattr(kl, "interpreter_on", lambda: True)
    assert not kl.shortcut_supported()


def test_a_bound_site_keeps_no_tensor_alive(fake):
    jit, _, calls, _ = fake
    site = KernelLaunch(jit, GRID, CONSTANTS)
    x = torch.zeros(64, dtype=torch.bfloat16)
    gone = []
    import weakref

    weakref.finalize(x, gone.append, 1)
    site(*_args(x=x))
    del x
    calls.clear()  # the stand-in launcher's record of it
    gc.collect()
    assert gone == [1]
    site(*_args())  # a new tensor where the dead one was: checked, still bound
    assert site.bound_launches == 1


def test_specialization_never_joins_what_triton_separates():
    """Two arguments with equal keys must get the same specialization from Triton (3.9 here, 3.6 on the GPU)."""
    backend = make_backend(GPUTarget("cuda", 90, 32))
    buf = torch.zeros(256, dtype=torch.uint8)
    values = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31), -(2**31) - 1,
              -(2**31) - 16, 2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 1, True, False, 0.0, 1.0, 0.5, None,
              buf, buf[1:], buf[2:], buf[8:], buf[16:], buf[32:], buf.view(torch.float32), buf[4:].view(torch.float32),
              buf.view(torch.bfloat16), buf[2:].view(torch.bfloat16), buf.view(torch.int64), buf.view(16, 16).t(),
              torch.zeros(0), (buf, 1), (buf, 2), (buf[1:], 2), (buf, 16), (0.5, None)]  # fmt: skip
    for specialize in (True, False):
        for align in (True, False):
            triton_keys = [native_specialize_impl(backend, v, False, specialize, align) for v in values]
            for i, a in enumerate(values):
                for j, b in enumerate(values):
                    if specialization(a) == specialization(b):
                        assert triton_keys[i] == triton_keys[j], (a, b)
    assert specialization(3, constexpr=True) != specialization(4, constexpr=True)


def test_a_cache_decode_step_launches_as_triton_would(fake, monkeypatch):
    """The decode plan's three sites in a real cache's steps: every launcher call equals the one Triton makes for the
    same arguments, and from the plan's second step on all three sites are bound."""
    import hfkv.kernels.decode_attention as da
    from hfkv import TriStateCache
    from hfkv.attention.interface import set_pending
    from hfkv.kernels.backend import backend_ops
    from tests.models import tiny_model

    _, _, calls, compiled = fake
    model = tiny_model("llama")
    cache = TriStateCache(model, "hfkv", backend="torch", budget=16, window=4)
    model(torch.randint(3, 128, (1, 30)), past_key_values=cache)  # the prompt's writes by the torch backend
    layer = cache.layers[0]
    layer.ops = layer.tiers.ops = backend_ops("triton")  # decode steps take the Triton path from here
    layer.steps_since_policy = -(10**6)  # no policy run in these steps
    for name in ("_partial_kernel", "_combine_kernel", "_score_kernel"):
        monkeypatch.setattr(da, name, _stand_in(getattr(da, name).fn, monkeypatch, calls, compiled))
    layer.reads.plan = None  # rebuilt with the stand-ins
    original, checked_calls = KernelLaunch.__call__, []

    def checked(self, *args):
        original(self, *args)
        ours = calls[-1]
        self.fn[self.grid](*args, **self.constants)
        assert _same(ours, calls[-1]), self.fn
        checked_calls.append(self.fn)

    monkeypatch.setattr(KernelLaunch, "__call__", checked)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        k, v, q = (torch.randn(1, h, 1, 32, generator=g) for h in (2, 2, 4))
        layer.update(k, v)
        set_pending(None)
        layer.attend(None, q, k, v, None, 32**-0.5)
    sites = layer.reads.plan.launches[True]
    assert len(checked_calls) == 12 and len(compiled) == 3
    assert [(s.triton_launches, s.bound_launches) for s in sites] == [(1, 3)] * 3


def test_torch_compile_over_a_site_launches_as_eager(fake):
    """dynamo (graph breaks allowed) over code that launches through a site: no error, and the launcher calls of
    the compiled function are the eager ones (issue 21's ``torch.compile`` of a model with a TriStateCache, on a
    GPU the decode plan's sites are in the traced attention)."""
    jit, _, calls, _ = fake
    y, parts = torch.zeros(32), (torch.zeros(8, dtype=torch.int64), 5)

    def step(site, x):
        site(x, y, 4096, 0.125, parts, True)
        return x + 1

    eager_site, compiled_site = KernelLaunch(jit, GRID, CONSTANTS), KernelLaunch(jit, GRID, CONSTANTS)
    compiled = torch.compile(step, backend="eager")
    try:
        for _ in range(3):
            x = torch.zeros(64, dtype=torch.bfloat16)
            step(eager_site, x)
            mine = calls[-1]
            assert torch.equal(compiled(compiled_site, x), x + 1)
            assert _same(calls[-1], mine)
    finally:
        torch._dynamo.reset()
    assert compiled_site.triton_launches + compiled_site.bound_launches == 3
