"""Is hfkv ready on this GPU? One command: compiled-kernel tests, decode-kernel bandwidth, end to end.

    python -m eval.gpu.check --out DIR              # a CUDA machine: <= 9 minutes on one H100
    python -m eval.gpu.check --out DIR --dry-run    # a CPU: every part, toy sizes, Triton's interpreter

Run from the repository root: the check imports ``tests`` (the kernel tests' helpers) and ``eval.kernel_bench``
as packages of this checkout, and runs pytest there.

A GPU lease is short and starts bare, so everything worth knowing comes out of one call, in three
parts, each with a deadline inside ``--budget-s``:

1. **tests**: the kernel tests and the ``generate`` equality tests, run by pytest in a subprocess
   without ``TRITON_INTERPRET``; the tests build CPU tensors, and the plugin ``tests/gpu_offload.py`` runs
   every Triton launch on the GPU (compiled) with the tests' own comparisons. Then on-device checks
   with the model itself on the GPU: ``generate`` with ``backend="triton"`` gives the tokens and
   statistics of ``backend="torch"`` (Llama and Qwen3 tiny random models as the tests build them, a
   left-padded batch of 2, every preset), decode steps between policy runs make no host sync
   (``torch.cuda.set_sync_debug_mode("error")``), nor does the step that runs a policy run prepared a step ahead
   (``TriStateConfig.run_ahead``).
2. **bandwidth**: ``eval/kernel_bench.py``'s functions: bytes the decode kernel must read over its
   time against the measured copy bandwidth and flash SDPA over a dense cache, for ``full``,
   ``quant`` and ``hfkv`` storage at 4k/16k/32k tokens x batch 1/8 (one layer of Llama-3.1-8B).
3. **e2e**: :mod:`eval.gpu.e2e`: a random-weight Llama-3.1-8B in bf16, prefill and
   decode steps of DynamicCache, hfkv at two budgets and QuantizedCache, peaks, largest batch.

Writes ``DIR/gpu_check.json``, ``DIR/gpu_check.png`` and ``DIR/summary.txt`` (also printed); the
fields are listed in docs/kernels.md, "Validating on a GPU: gpu_check". Items that would not fit in
the time left are recorded as skipped with the reason (``skipped`` in the JSON and the summary);
nothing is cut off half-way except the pytest run, whose finished tests are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from eval.gpu import report
from eval.gpu.report import error_text

PARTS = ("tests", "bandwidth", "e2e")
# Cumulative deadlines as shares of the budget: a part that ends early leaves its time to the next.
DEADLINES = {"tests": 0.38, "bandwidth": 0.60, "e2e": 0.97}
DEFAULT_BUDGET_S = 510.0  # of the 600 s a lent H100 runs one command, installing the wheels included
DRY_BUDGET_S = 150.0
KERNEL_TESTS = (
    "tests/test_kernel_decode_attention.py",
    "tests/test_kernel_dequant.py",
    "tests/test_kernel_encode.py",
    "tests/test_kernel_compact.py",
    "tests/test_kernel_meta.py",
    "tests/test_kernel_allocate.py",
    "tests/test_kernel_reserve.py",
    "tests/test_kernel_changes.py",
    "tests/test_kernel_gather.py",
    "tests/test_kernel_observation.py",
    "tests/test_policy_apply.py",
    "tests/test_backend_triton.py",
)
# The kernel and generate tests; not the CPU kernel's, nor those about the interpreter or the CPU's backend choice.
SELECTION = "(triton or encode) and not (cpu or host_sync or backend_selection or too_late or compiler)"
DRY_SELECTION = "(single_token or masking_is_by_slot) and not cpu"
PYTEST_SHARE = 0.7  # of the tests part's time at least; the on-device checks get the rest
# What the on-device checks after pytest take on a GPU (H200, twelfth lease: ten generate checks ~4 s, two graph
# replays ~14 s each): pytest may use the tests part's time up to this reserve. That lease's pytest, held to 70% of a
# 160 s part with 8 workers, ran 215 of the 218 tests.
CHECKS_RESERVE_S = 40.0


# --------------------------------------------------------------------------------------------- budget
@dataclass
class Budget:
    """Seconds left before each part's deadline (:data:`DEADLINES` of ``total_s``), and what was skipped."""

    total_s: float
    clock: Callable[[], float] = time.monotonic
    start: float = 0.0
    skipped: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.start = self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self, part: str) -> float:
        return self.start + self.total_s * DEADLINES[part] - self.clock()

    def allows(self, part: str, item: str, need_s: float) -> bool:
        """Whether ``item`` (about ``need_s`` seconds) fits before ``part``'s deadline; if not, it is recorded."""
        left = self.left(part)
        if need_s <= left:
            return True
        self.skip(part, item, f"time budget: needs about {need_s:.0f} s, {max(left, 0):.0f} s left of this part")
        return False

    def skip(self, part: str, item: str, reason: str) -> None:
        self.skipped.append({"part": part, "item": item, "reason": reason})


REPO = Path(__file__).resolve().parents[2]  # the checkout this module is in: its tests/ run in the tests part


# ---------------------------------------------------------------------------------------------- tests
# The compiled tests whose failure says the decode kernel's newest code path (the PTX dequantization) is wrong on this
# GPU: eval/gpu_lease.sh turns that path off for the rest of its call before it times anything.
DECODE_PATH_TESTS = ("tests/test_kernel_decode_attention.py", "tests/test_kernel_dequant.py")


# Test ids of launch options that are off by default (``code_dots``): a failure there says that option is wrong, not
# that the default launch is, so it does not turn the default's PTX off (eval/gpu_lease.sh); it stays in the report.
OPT_IN_MARKS = ("code-dots", "code_dots")


def decode_path_failures(result: dict[str, Any]) -> list[str]:
    """The failed or erroring tests of :data:`DECODE_PATH_TESTS` in a ``gpu_check.json`` that run the default
    launch (not :data:`OPT_IN_MARKS`'; a run without the tests part has none)."""
    failures = result.get("parts", {}).get("tests", {}).get("pytest", {}).get("failures", [])
    return [
        f["test"] for f in failures
        if f["test"].split("::")[0] in DECODE_PATH_TESTS and not any(m in f["test"] for m in OPT_IN_MARKS)
    ]  # fmt: skip


def pytest_outcomes(lines: Sequence[str]) -> dict[str, Any]:
    """Counts and failures from ``tests/gpu_offload.py``'s report (one JSON line per test phase, and one of the
    selected tests), and the selected tests that reported nothing (``not_run``: a run stopped at its deadline)."""
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    final: dict[str, tuple[str, str]] = {}
    collected: list[str] | None = None
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # blank, or a line two processes wrote into each other
            continue
        if "collected" in row:
            collected = row["collected"]
            continue
        outcome = row["outcome"]
        if row["when"] != "call" and outcome == "failed":
            outcome = "error"
        prev = final.get(row["test"])
        if prev is None or rank[outcome] > rank[prev[0]]:
            final[row["test"]] = (outcome, row.get("message", ""))
    counts = {k: sum(1 for o, _ in final.values() if o == k) for k in rank}
    failures = [
        {"test": t, "outcome": o, "message": m[-1500:]} for t, (o, m) in final.items() if o in ("failed", "error")
    ]
    not_run = None if collected is None else [t for t in collected if t not in final]
    return {**counts, "failures": failures, "collected": None if collected is None else len(collected),
            "not_run": not_run}  # fmt: skip


def pytest_workers(dry_run: bool) -> int:
    """pytest-xdist workers for the compiled run: compiling ~100 kernel configurations is the slow part, and
    it runs in parallel across processes (each its own CUDA context on the one GPU)."""
    import importlib.util

    cpus = os.cpu_count() or 1
    if dry_run or cpus < 4 or importlib.util.find_spec("xdist") is None:
        return 0
    return min(14, cpus - 2)  # two cores for the GPU's driver threads and the parent


def run_pytest(device: str, selection: str, timeout_s: float, interpret: bool, workers: int = 0) -> dict[str, Any]:
    """The kernel tests in a subprocess in :data:`REPO`, their Triton launches on ``device`` (the pytest plugin
    ``tests/gpu_offload.py``).

    The run gets its own process group, so at its deadline the workers go with it; the tests that
    finished by then are in the report file all the same.
    """
    import signal

    from tests.gpu_offload import ENV_DEVICE, ENV_REPORT

    fd, report = tempfile.mkstemp(prefix="hfkv_gpu_check_", suffix=".jsonl")
    os.close(fd)
    # not the calling pytest's own xdist variables (a suite run with -n): gpu_offload reads the child run's
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("PYTEST_XDIST")}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env.update({ENV_DEVICE: device, ENV_REPORT: report, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.gpu_offload"]
    cmd += ["-n", str(workers)] if workers else []
    cmd += ["-k", selection, *KERNEL_TESTS]
    out: dict[str, Any] = {"command": shlex.join(cmd[1:]), "device": device, "interpreter": interpret}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        tail, _ = proc.communicate(timeout=max(1.0, timeout_s))
        out["returncode"], out["timed_out"] = proc.returncode, False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        tail, _ = proc.communicate()
        out["returncode"], out["timed_out"] = None, True
    out["seconds"] = round(time.monotonic() - t0, 1)
    out["output_tail"] = (tail or "")[-2500:]
    try:
        lines = Path(report).read_text(encoding="utf-8").splitlines()
    finally:
        os.unlink(report)
    out.update(pytest_outcomes(lines))
    return out


def _generate_check(tb, models, family: str, preset: str, device: str, new_tokens: int) -> tuple[bool, str]:
    """``generate`` on ``device`` with the Triton kernels against the torch backend, as test_backend_triton does."""
    import torch

    model = models.tiny_model(family, num_hidden_layers=1 if family == "qwen3" else 2).to(device)
    if family == "llama":  # a left-padded batch of 2
        ids, mask = models.left_padded_batch(lengths=(28, 19))
    else:
        ids = torch.randint(3, 128, (1, 26), generator=torch.Generator().manual_seed(4))
        mask = torch.ones_like(ids)
    ids, mask = ids.to(device), mask.to(device)
    ref, ref_cache = tb._generate(model, ids, mask, preset, "torch", new_tokens)
    got, got_cache = tb._generate(model, ids, mask, preset, "triton", new_tokens)
    if not torch.equal(got, ref):
        first = int((got != ref).any(0).nonzero()[0])
        return False, f"tokens from position {first}: triton {got[:, first:].tolist()}, torch {ref[:, first:].tolist()}"
    if tb._stats_key(got_cache) != tb._stats_key(ref_cache):
        return False, f"statistics differ: triton {tb._stats_key(got_cache)} torch {tb._stats_key(ref_cache)}"
    backend = got_cache.stats().backend if preset != "full" else "n/a (full keeps DynamicLayers)"
    return True, f"{got.shape[1] - ids.shape[1]} tokens equal, backend {backend}"


def _decode_step(layer, k, v, q):
    """One layer's decode step as the model makes it: ``update()``, then the hfkv attention function's ``attend()``
    (its output returned)."""
    from hfkv.attention.interface import set_pending

    layer.update(k, v)
    set_pending(None)  # what the hfkv attention function does before calling attend()
    return layer.attend(None, q, k, v, None, 32**-0.5)


def _run_ahead_no_sync_check(models, device: str) -> tuple[bool, str]:
    """The step that runs a policy run prepared a step ahead (``TriStateConfig.run_ahead``) waits for nothing: its
    plan's numbers were copied to pinned memory behind the step before, so the run's ``update()`` runs under
    ``set_sync_debug_mode("error")`` (CUDA only; tests/test_policy_launches.py counts the same read on a CPU)."""
    import torch

    from hfkv import TriStateCache
    from hfkv.attention.interface import set_pending

    model = models.tiny_model("llama", num_hidden_layers=1).to(device)  # the steps below use layer 0 alone
    cache = TriStateCache(model, "arkv", backend="triton", budget=20, window=4, interval=4)
    model(torch.randint(3, 128, (1, 30)).to(device), past_key_values=cache)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(1)
    shapes = ((1, 2, 1, 32), (1, 2, 1, 32), (1, 4, 1, 32))

    def inputs():
        return [torch.randn(*s, generator=g).to(device) for s in shapes]

    for _ in range(16):  # decode until a step has prepared the next one's run
        _decode_step(layer, *inputs())
        if layer.policy.ahead is not None:
            break
    else:
        return False, "no policy run was prepared ahead in 16 decode steps"
    finished = layer.runs_ahead
    k, v, q = inputs()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer.update(k, v)  # runs the policy: the prepared run's read and its moves
    finally:
        torch.cuda.set_sync_debug_mode(0)
    set_pending(None)
    layer.attend(None, q, k, v, None, 32**-0.5)
    if layer.runs_ahead == finished:
        return False, "the step did not finish the prepared run"
    return True, "the run's step: no host sync (set_sync_debug_mode('error'))"


def _no_sync_check(models, device: str) -> tuple[bool, str]:
    """Decode steps between policy runs read no device value on the host (test_backend_triton's test, on ``device``).

    On CUDA the driver says so (``set_sync_debug_mode("error")``); on a CPU (dry run) launches are
    recorded instead of run and every tensor method that would wait for a device raises.
    """
    import contextlib

    import torch

    from hfkv import TriStateCache

    model = models.tiny_model("llama", num_hidden_layers=1).to(device)  # the steps below use layer 0 alone
    cache = TriStateCache(model, "hfkv", backend="triton", budget=16, window=4)
    model(torch.randint(3, 128, (1, 30)).to(device), past_key_values=cache)
    layer = cache.layers[0]
    layer.steps_since_policy = -(10**6)  # keep the policy (which sizes its moves on the host) out of these steps
    layer.budget.tier_peak = 0
    g = torch.Generator().manual_seed(0)
    shapes = ((1, 2, 1, 32), (1, 2, 1, 32), (1, 4, 1, 32))  # k, v of 2 KV heads; q of 4 query heads
    steps = [[torch.randn(*s, generator=g).to(device) for s in shapes] for _ in range(4)]
    cuda = torch.device(device).type == "cuda"

    step = partial(_decode_step, layer)
    step(*steps.pop(0))  # builds the launch plan (one asynchronous copy of the parts' sizes); the rest reuse it
    with contextlib.ExitStack() as stack:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            stack.callback(torch.cuda.set_sync_debug_mode, 0)
        else:
            from triton.runtime.interpreter import InterpretedFunction

            def forbidden(*args, **kwargs):
                raise AssertionError("host sync on the decode path")

            saved = {n: getattr(torch.Tensor, n) for n in ("item", "tolist", "nonzero", "__bool__", "cpu", "numpy")}
            run = InterpretedFunction.run
            InterpretedFunction.run = lambda self, *a, grid, warmup, **k: None
            stack.callback(setattr, InterpretedFunction, "run", run)
            for name in saved:
                setattr(torch.Tensor, name, forbidden)
                stack.callback(setattr, torch.Tensor, name, saved[name])
            from hfkv.kernels.host_scalars import NoHostScalars

            stack.enter_context(NoHostScalars())
        for k, v, q in steps:
            step(k, v, q)
    how = "set_sync_debug_mode('error')" if cuda else "launches recorded, host reads forbidden"
    return True, f"3 decode steps, no host sync ({how})"


def _bound_launch_check(models, device: str, steps: int = 24) -> tuple[bool, str]:
    """Decode steps whose three launches take hfkv's bound sites (hfkv.kernels.launch) give the outputs of steps
    launched through Triton's own path (``HFKV_TRITON_BINDING=1`` when the plan is made), bit for bit, and the host
    time of each kind of step (medians, steps interleaved, launches asynchronous) says what the binding costs with
    the driver's real launcher. On a CPU the interpreter launches through Triton either way (nothing is bound)."""
    import statistics

    import torch

    from hfkv import TriStateCache
    from hfkv.kernels import launch as kl

    model = models.tiny_model("llama", num_hidden_layers=1).to(device)
    prompt = torch.randint(3, 128, (1, 30)).to(device)
    layers = []
    for _ in range(2):  # launched through bound sites, and through Triton's own path
        # a ring long enough for the steps below without a policy run, so one plan serves them all
        cache = TriStateCache(model, "hfkv", backend="triton", budget=96, window=4, interval=32, dense_phase=False)
        model(prompt, past_key_values=cache)
        layer = cache.layers[0]
        layer.steps_since_policy = -(10**6)
        layer.budget.tier_peak = 0
        layers.append(layer)
    g = torch.Generator().manual_seed(2)
    shapes = ((1, 2, 1, 32), (1, 2, 1, 32), (1, 4, 1, 32))
    cuda = torch.device(device).type == "cuda"
    steps = min(steps if cuda else 2, layers[0].decode_steps_before_policy())
    host: list[list[float]] = [[], []]
    for i in range(steps):
        k, v, q = (torch.randn(*s, generator=g).to(device) for s in shapes)
        outs = []
        for opt_out, layer in enumerate(layers):
            before = os.environ.get(kl.ENV_TRITON_BINDING)
            if opt_out:
                os.environ[kl.ENV_TRITON_BINDING] = "1"  # read when the step's plan makes its sites
            try:
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                outs.append(_decode_step(layer, k, v, q))
                if i:  # the first step of each builds its plan
                    host[opt_out].append(1e6 * (time.perf_counter() - t0))
            finally:
                if opt_out and before is None:
                    os.environ.pop(kl.ENV_TRITON_BINDING)
        if not torch.equal(outs[0], outs[1]):
            diff = (outs[0] - outs[1]).abs().max()
            return False, f"step {i}: bound launches' output differs from Triton's (largest difference {diff})"
    sites = [layer.reads.plan.launches[True] for layer in layers]
    bound = [s.bound_launches for s in sites[0]]
    if any(s.bound_launches for s in sites[1]) or (cuda and min(bound) < steps - 1):
        return False, f"bound launches per site: {bound} (opted out: {[s.bound_launches for s in sites[1]]})"
    if not cuda:
        return True, "interpreter: both launched through Triton, outputs equal"
    ours, theirs = (statistics.median(h) for h in host)
    return True, (f"{steps} steps equal; host per layer's step: bound {ours:.0f} us, Triton's path {theirs:.0f} us "
                  f"(medians); bound launches per site {bound}")  # fmt: skip


def _graph_modes() -> tuple[str, ...]:
    from hfkv.graphs import MODES  # above the kernels: imported where used

    return MODES


def isolated(check: Callable[..., tuple[bool, str]], *args: Any) -> tuple[bool, str]:
    """``check(*args)`` (a module-level function, picklable arguments) in a spawned process, its exception a failed
    result. A CUDA graph capture that fails half-way leaves the process's CUDA generator capturing: in run 14 the
    next random weights on the GPU, the end-to-end part's model, raised "Offset increment outside graph capture",
    and that part measured nothing. The checks that capture run in a process of their own, so their failure stays
    theirs (a spawn costs the imports and a CUDA context, a few seconds)."""
    import multiprocessing

    try:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            return pool.apply(_checked, (check, args))
    except Exception as exc:  # noqa: BLE001 - a child that could not run the check is a failed check
        return False, f"the check's process: {error_text(exc)}"


def _checked(check: Callable[..., tuple[bool, str]], args: tuple) -> tuple[bool, str]:
    try:
        return check(*args)
    except Exception as exc:  # noqa: BLE001 - a failing check is a result
        return False, error_text(exc)


def _graph_check_in(device: str, mode: str) -> tuple[bool, str]:
    """:func:`_graph_check` with the tests' model helpers, imported in the process it runs in (a spawned one, whose
    import path is its parent's)."""
    from tests import models

    return _graph_check(models, device, mode)


def _graph_check(models, device: str, mode: str, new_tokens: int = 40) -> tuple[bool, str]:
    """Greedy decoding through hfkv.graphs.GraphedDecoder in ``mode`` gives the tokens and token states of eager
    decoding with the same cache configuration. The budget is one the prompt does not fill, so some policy
    runs grow the storage and the later ones do not: ``"layers"`` captures once and replays every later step
    (policy runs in its eager cache calls), ``"steps"`` captures again after a run that grew something and
    reuses its graph across the others (on a CPU with a recording for the graph: 3 captures, 2 reuses)."""
    import torch

    from hfkv import TriStateCache
    from hfkv.evaluation.bench import decode_step
    from hfkv.graphs import GraphedDecoder

    model = models.tiny_model("llama", num_hidden_layers=2).to(device)
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(6)).to(device)
    caches = [TriStateCache(model, "hfkv", backend="triton", budget=56, window=4, dense_phase=False) for _ in range(2)]
    decoder = GraphedDecoder(model, caches[1], mode=mode)  # a bad mode is refused before any decoding
    with torch.inference_mode():
        out = model(input_ids=ids, past_key_values=caches[0], use_cache=True, logits_to_keep=1)
        eager = [out.logits[:, -1:].argmax(-1)]
        for i in range(new_tokens - 1):  # as GraphedDecoder.generate steps
            eager.append(decode_step(model, caches[0], eager[-1], ids.shape[1] + i))
    eager = torch.cat(eager, dim=1)
    graphed = decoder.generate(ids, new_tokens)
    if not torch.equal(graphed, eager):
        first = int((graphed != eager).any(0).nonzero()[0])
        return False, f"tokens from step {first}: graphed {graphed[:, first:].tolist()}, eager {eager[:, first:]}"
    for i, (a, b) in enumerate(zip(caches[0].layers, caches[1].layers, strict=True)):
        if not torch.equal(a.token_states(), b.token_states()):
            return False, f"layer {i}: token states differ after {new_tokens} tokens"
    if mode == "layers" and decoder.counts["replayed"] != new_tokens - 2:
        return False, f"a step after the capture was not replayed: {decoder.counts}"
    if mode == "steps" and (decoder.counts["replayed"] < 1 or decoder.counts["reused"] < 1):
        return False, f"no step was replayed, or no graph reused across a policy run: {decoder.counts}"
    return True, f"{new_tokens} tokens and token states equal; steps {decoder.counts}"


def run_tests(device: str, budget: Budget, dry_run: bool, new_tokens: int, out: dict, save: Callable) -> dict[str, Any]:
    """The tests part (module docstring), filling ``out`` as it goes; ``save()`` after each result."""
    out["checks"] = []
    left = budget.left("tests")
    pytest_s = max(left * PYTEST_SHARE, left - CHECKS_RESERVE_S)
    if budget.allows("tests", "pytest", 30.0):
        selection = DRY_SELECTION if dry_run else SELECTION
        out["pytest"] = run_pytest(device, selection, pytest_s, dry_run, pytest_workers(dry_run))
        if out["pytest"]["timed_out"]:
            budget.skip("tests", "pytest (the rest)", f"stopped at its share of the budget ({pytest_s:.0f} s)")
        save()
    try:
        from tests import models
        from tests import test_backend_triton as tb
    except Exception as exc:  # noqa: BLE001 - the checks need the tests' helpers; say why they did not run
        budget.skip("tests", "on-device checks", f"tests' helpers did not import: {error_text(exc)}")
        return out
    plan: list[tuple[str, Callable[[], tuple[bool, str]]]] = []
    families, presets = (["llama"], ["quant"]) if dry_run else (["llama", "qwen3"], list(tb.PRESETS))
    for family in families:
        for preset in presets:
            name = f"generate {family} {preset}: triton == torch on {device}"
            plan.append((name, lambda f=family, p=preset: _generate_check(tb, models, f, p, device, new_tokens)))
    plan.append((f"decode step makes no host sync on {device}", lambda: _no_sync_check(models, device)))
    plan.append((f"bound launches == Triton's launches on {device}", lambda: _bound_launch_check(models, device)))
    if device.startswith("cuda"):
        plan.append((f"a policy run prepared a step ahead makes no host sync on {device}",
                     lambda: _run_ahead_no_sync_check(models, device)))  # fmt: skip
        for mode in _graph_modes():
            plan.append((f"CUDA graph replay of decode steps ({mode}) == eager on {device}",
                         lambda m=mode: isolated(_graph_check_in, device, m)))  # fmt: skip
    else:
        budget.skip("tests", "CUDA graph replay check", "CUDA graphs need a CUDA device")
        budget.skip("tests", "run-ahead sync check", "the copy it checks (pinned memory, an event) is CUDA's")
    est = 5.0
    for name, check in plan:
        if not budget.allows("tests", name, est):
            continue
        t0 = time.monotonic()
        try:
            ok, detail = check()
        except Exception as exc:  # noqa: BLE001 - a failing check is a result
            ok, detail = False, error_text(exc)
        dt = time.monotonic() - t0
        est = max(est, 1.5 * dt)  # the next check is of the same kind: at most about as long
        out["checks"].append({"name": name, "ok": ok, "detail": detail, "seconds": round(dt, 2)})
        save()
    return out


# ------------------------------------------------------------------------------------------ bandwidth
def _cpu_copy_bandwidth(kb, nbytes: int = 64 << 20) -> dict[str, Any]:
    import torch

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    t = kb.time_fn(lambda: dst.copy_(src), "cpu", repeats=5, warmup=1, graph=False, flush_bytes=0)
    gbps = 2 * nbytes / (t["ms_median"] / 1e3) / 1e9
    return {"bytes": nbytes, "gbps": gbps, "timing": t, "convention": "2 * bytes / time (CPU, dry run)"}


def _cpu_sdpa(context: int, batch: int, shape, repeats: int, kb) -> dict[str, Any]:
    """The dry run's SDPA beside a kernel case: the math backend on the CPU (kernel_bench's is CUDA-only)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1)
    d, dt = shape.head_dim, shape.dtype
    q = torch.randn(batch, shape.heads, 1, d, generator=g).to(dt)
    k = torch.randn(batch, shape.kv_heads, context, d, generator=g).to(dt)
    v = torch.randn(batch, shape.kv_heads, context, d, generator=g).to(dt)
    t = kb.time_fn(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), "cpu", repeats, warmup=1)
    b = kb.sdpa_bytes(context, batch, shape)
    return {"layout": "gqa (cpu math)", "timing": t, "read_bytes": b["read_total"], "write_bytes": b["write_total"]}


def run_bandwidth(args, budget: Budget, cuda: bool, out: dict, save: Callable) -> dict[str, Any]:
    """Decode-kernel rows of eval/kernel_bench.py (its functions, this budget) and the targets read off them."""
    import torch

    from eval import kernel_bench as kb

    out["rows"] = []
    shape = kb.AttnShape.like("llama-3.1-8b") if cuda else kb.AttnShape(4, 2, 32, torch.bfloat16)
    out["shape"] = {"heads": shape.heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "dtype": "bf16"}
    out["copy_bandwidth"] = kb.measure_copy_bandwidth() if cuda else _cpu_copy_bandwidth(kb)
    copy_gbps = out["copy_bandwidth"]["gbps"]
    if cuda:
        kb._free_cuda()
    free = torch.cuda.mem_get_info()[0] if cuda else 1 << 40
    cases = kb.enumerate_cases(args.kinds, args.contexts, args.batches, shape, free)
    sdpa: dict[tuple[int, int], dict[str, Any]] = {}
    checked: set[str] = set()
    # Seconds per case: a fixed part, a part per (row, head, token) record (a first guess, raised by what
    # larger cases took), and a kind's first case compiles its kernels.
    per_record, fixed, compile_s = (2e-6, 4.0, 20.0) if cuda else (2e-3, 2.0, 0.0)
    kinds_seen: set[str] = set()
    for case in cases:
        plan = case.plan
        records = plan.batch * shape.kv_heads * plan.context
        item = f"{plan.kind} context {plan.context} batch {plan.batch}"
        first = plan.kind not in kinds_seen
        if not budget.allows("bandwidth", item, fixed + compile_s * first + per_record * records):
            continue
        t0 = time.monotonic()
        key = (plan.context, plan.batch)
        if key not in sdpa:
            if case.sdpa_skip:
                sdpa[key] = {"skipped": case.sdpa_skip}
            else:
                try:
                    run = kb.bench_sdpa if cuda else lambda c, b, s, r, f: _cpu_sdpa(c, b, s, r, kb)
                    sdpa[key] = run(plan.context, plan.batch, shape, args.repeats, free)
                except Exception as exc:  # noqa: BLE001
                    sdpa[key] = {"error": error_text(exc)}
        if case.skip:
            res: dict[str, Any] = {"skipped": case.skip}
        else:
            check = plan.kind not in checked and records <= kb.CHECK_MAX_RECORDS
            try:
                dev = "cuda" if cuda else "cpu"
                res = kb.bench_kernel_case(plan, dev, args.repeats, args.warmup, cuda, check)
                if check:
                    checked.add(plan.kind)
            except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
                res = {"error": error_text(exc)}
            if cuda:
                kb._free_cuda()
        row = kb.kernel_row(plan, kb.kernel_bytes(plan), res, copy_gbps, sdpa[key])
        row["memory_need_bytes"] = case.need
        row["seconds"] = round(time.monotonic() - t0, 2)
        out["rows"].append(row)
        save()
        if not first and records >= 1 << 17:  # a large case, no compilation in it: its time is mostly per record
            per_record = max(per_record, 1.3 * row["seconds"] / records)
        kinds_seen.add(plan.kind)
    out["targets"] = kb.summarize_targets(out["rows"], None)
    return out


# ----------------------------------------------------------------------------------------------- main
def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (e.g. 510)") from None
    if not 30 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r} must be between 30 and 3600 seconds")
    return value


def _ints(what: str, example: str):
    from hfkv import cli_args as ca

    return ca.integer_list(1, what=what, example=example)


def build_parser() -> argparse.ArgumentParser:
    from hfkv import cli_args as ca
    from hfkv.evaluation.methods import method_specs

    p = ca.ArgumentParser(
        prog="python -m eval.gpu.check",
        description=__doc__.splitlines()[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="gpu_check_out", help="folder of the three files (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="on the CPU, Triton's interpreter, toy sizes (1-2 min)")
    p.add_argument(
        "--budget-s",
        type=_seconds,
        default=None,
        help=f"seconds for all parts (default {DEFAULT_BUDGET_S:g}; dry run {DRY_BUDGET_S:g})",
    )
    p.add_argument("--parts", type=ca.names(PARTS, "part"), default=",".join(PARTS), help="default: %(default)s")
    g = p.add_argument_group("bandwidth (defaults for a GPU; the dry run's are toy sizes)")
    g.add_argument(
        "--contexts", type=_ints("token counts", "4096,32768"), help="tokens per row (default 4096,16384,32768)"
    )
    g.add_argument("--batches", type=_ints("batch sizes", "1,8"), help="batch sizes (default 1,8)")
    g.add_argument(
        "--kinds",
        type=ca.names(("full", "quant", "hfkv"), "storage kind"),
        default="full,quant,hfkv",
        help="storage kinds (default: %(default)s)",
    )
    g.add_argument("--repeats", type=ca.integer(1), help="timed calls per case (default 30)")
    g.add_argument("--warmup", type=ca.integer(0), help="untimed calls first (default 3)")
    e = p.add_argument_group("end to end")
    e.add_argument(
        "--e2e-contexts", type=_ints("token counts", "8192,32768"), help="prompt lengths (default 8192,32768)"
    )
    e.add_argument("--e2e-batches", type=_ints("batch sizes", "1,8"), help="batch sizes (default 1,8)")
    e.add_argument(
        "--budgets", type=_ints("hfkv budgets", "1024,4096"), help="hfkv fp_tokens per KV head (default 1024,4096)"
    )
    e.add_argument("--e2e-steps", type=ca.integer(1), help="timed decode steps (default 24)")
    e.add_argument("--e2e-warmup", type=ca.integer(0), help="untimed decode steps first (default 2)")
    e.add_argument(
        "--e2e-interleave",
        type=ca.integer(0),
        help="decode steps of DynamicCache and each hfkv cache in turns after their own (default 24; 0: none)",
    )
    e.add_argument(
        "--e2e-chunk",
        type=ca.integer(1),
        default=4096,
        help="prefill chunk of DynamicCache / QuantizedCache where one forward runs out of memory (default 4096)",
    )
    e.add_argument(
        "--e2e-extra",
        nargs="+",
        type=method_specs,
        default=[],
        metavar="SPEC",
        help="more caches for the end-to-end part, as hfkv bench's method specs (hfkv ones on the Triton backend "
        "unless the spec names one), e.g. 'hfkv@1024:interval=32'",
    )
    e.add_argument(
        "--no-e2e-graphs",
        dest="e2e_graphs",
        action="store_false",
        help="skip the hfkv rows whose decode steps replay CUDA graphs (hfkv.graphs)",
    )
    e.add_argument(
        "--e2e-graph-modes",
        type=ca.names(_graph_modes, "GraphedDecoder mode"),
        default=["layers"],
        help="GraphedDecoder modes of the graphed hfkv rows, one row each (layers, steps; default layers)",
    )
    e.add_argument(
        "--e2e-sdpa",
        default="flash,efficient,math",
        help="torch SDPA backends the end-to-end part may use, by priority ('default': torch's choice, which "
        "on an H200 is cuDNN, whose plan per new key length costs DynamicCache ~1.3 ms a layer; default: %(default)s)",
    )
    e.add_argument(
        "--quanto-cuda-extension",
        action="store_true",
        help="let optimum-quanto build its CUDA extension (minutes of nvcc); default: its Python unpack",
    )
    return p


GPU_DEFAULTS = dict(
    contexts=[4096, 16384, 32768], batches=[1, 8], repeats=30, warmup=3,
    e2e_contexts=[8192, 32768], e2e_batches=[1, 8], budgets=[1024, 4096], e2e_steps=24, e2e_warmup=2,
    e2e_interleave=24,
)  # fmt: skip
# Toy sizes: above the hfkv ring (window 16 + interval 8), a budget room beyond it.
DRY_DEFAULTS = dict(
    contexts=[64], batches=[1, 2], repeats=1, warmup=0,
    e2e_contexts=[40], e2e_batches=[1, 2], budgets=[48, 64], e2e_steps=2, e2e_warmup=0,
    e2e_interleave=2,
)  # fmt: skip


def check_args(args) -> None:
    """Fill the defaults of the mode (GPU or dry run); refuse what cannot run, naming the option."""
    from hfkv import cli_args as ca

    for key, value in (DRY_DEFAULTS if args.dry_run else GPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.budget_s is None:
        args.budget_s = DRY_BUDGET_S if args.dry_run else DEFAULT_BUDGET_S
    if "hfkv" in args.kinds and min(args.contexts) <= 24:
        raise ca.UsageError("--contexts", f"{min(args.contexts)} must exceed 24, the hfkv kind's window ring")
    from hfkv.evaluation.bench import sdpa_backends

    try:
        sdpa_backends(args.e2e_sdpa)
    except ValueError as exc:
        raise ca.UsageError("--e2e-sdpa", str(exc)) from None
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ca.UsageError("--out", f"{args.out!r} is a file; give a folder (it is created if missing)")


def main(argv: list[str] | None = None) -> int:
    from hfkv.cli_args import UsageError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        check_args(args)
    except UsageError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton reads it when a function is decorated, and `python -m` imported hfkv (and triton) already.
        if argv is not None or "triton" not in sys.modules:
            os.environ["TRITON_INTERPRET"] = "1"
        else:
            os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *sys.argv[1:]],
                      {**os.environ, "TRITON_INTERPRET": "1"})  # fmt: skip
    import torch

    cuda = torch.cuda.is_available() and not args.dry_run
    if not args.dry_run and os.environ.get("TRITON_INTERPRET") == "1":
        print(
            f"{parser.prog}: TRITON_INTERPRET=1 would run the kernels in Triton's interpreter, not compiled on the "
            "GPU; unset it (or add --dry-run for the CPU rehearsal)",
            file=sys.stderr,
        )
        return 2
    if not cuda and not args.dry_run:
        print(
            f"{parser.prog}: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU, or "
            "--dry-run for the CPU rehearsal in Triton's interpreter",
            file=sys.stderr,
        )
        return 2
    if args.dry_run and not _interpreted():
        print(
            f"{parser.prog}: --dry-run: triton was imported before TRITON_INTERPRET=1 was set; set it in the "
            "environment (TRITON_INTERPRET=1 python -m eval.gpu.check --dry-run ...)",
            file=sys.stderr,
        )
        return 2
    device = "cuda" if cuda else "cpu"
    budget = Budget(args.budget_s)
    result = report.header(args, device, budget, DEADLINES)
    out_dir = Path(args.out)

    def save() -> None:
        report.write(out_dir, result, budget, final=False)

    for part in PARTS:
        if part not in args.parts:
            budget.skip(part, "everything", "not in --parts")
            continue
        t0 = time.monotonic()
        print(f"gpu_check: {part} ({budget.left(part):.0f} s until its deadline)", flush=True)
        body: dict[str, Any] = {"status": "running"}  # filled as the part goes, saved after each result
        result["parts"][part] = body
        try:
            if part == "tests":
                run_tests(device, budget, args.dry_run, 3 if args.dry_run else 10, body, save)
            elif part == "bandwidth":
                run_bandwidth(args, budget, cuda, body, save)
            else:
                from eval.gpu.e2e import run_e2e

                run_e2e(args, budget, device, body, save)
            body["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - one broken part must not cost the others
            body.update(status="error", error=error_text(exc))
            budget.skip(part, "the rest", f"the part raised {error_text(exc)}")
        body["seconds"] = round(time.monotonic() - t0, 1)
        save()
        if cuda:
            _release_cuda()
    text = report.write(out_dir, result, budget, final=True)
    print(text)
    return 0


def _interpreted() -> bool:
    """Whether both hfkv's kernels and triton.language's own jitted helpers run in the interpreter."""
    import triton.language as tl

    from hfkv.kernels.decode_kernels import _partial_kernel

    return all(type(f).__name__ == "InterpretedFunction" for f in (_partial_kernel, tl.min))


def _release_cuda() -> None:
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()


if __name__ == "__main__":
    raise SystemExit(main())
