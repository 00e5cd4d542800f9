"""Host time of Triton's own launch path for hfkv's kernels: what eval/host_overhead.py leaves out, on a CPU.

eval/host_overhead.py records Triton launches instead of making them, so its figures hold hfkv's Python and torch's
dispatch but not Triton's launch path: ``JITFunction.run`` binds the call's arguments, specializes each one (a
pointer's alignment, an integer's divisibility by 16 or equality to 1), builds the compiled kernel's cache key and
looks it up, before the driver's launcher runs. That path is Python and needs no GPU up to the lookup, so it is timed
here with the Triton the GPU machine runs (3.6, installed for the ahead-of-time checks in ``.aot-triton``) and a CUDA
sm_90 target, on the arguments hfkv really passes:

1. **record** (this checkout's Triton, interpreter): eval/host_overhead.py's one-layer cache of Llama-3.1-8B's
   attention shape at ``--context`` x ``--batch``, decoded for one policy interval; every Triton launch is recorded
   (kernel, arguments) and run, except the decode step's three, whose outputs the host never reads (they would take
   minutes in the interpreter), and each launch is marked with the kind of step it fell in.
2. **time** (a second process with ``PYTHONPATH=.aot-triton``): per recorded launch, the kernel's binder for sm_90
   and ``compute_cache_key``, called ``--repeats`` times: microseconds per launch. Not in it: the driver's launcher
   (it converts each argument in C, then ``cuLaunchKernelEx``) and ``launch_metadata``, which need a device.
   Then the plain steps' decode launches through hfkv's bound sites (:func:`time_bound_sites`, JSON ``bound``):
   what a decode step pays instead of that binding since the decode plan launches through them.

    python -m eval.launch_binding --wait-quiet 600     # writes hfkv-out/eval/launch_binding_triton36.json (working dir)
    python -m eval.launch_binding --wait-quiet 600 --out eval/results/launch_binding_triton36.json   # the committed one

Run from the repository root as ``python -m eval.launch_binding``: it imports ``eval.host_overhead`` of this package
(a plain ``python -m eval.launch_binding`` puts only its own folder on the import path, which does not reach them).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when hfkv's kernels are decorated, so before any import

import argparse  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
AOT_TRITON = REPO / ".aot-triton"
# a run's default output, under the working directory; the committed eval/results/ only by --out
DEFAULT_OUT = Path("hfkv-out/eval/launch_binding_triton36.json")


def record(path: Path, context: int, batch: int, budget: int) -> None:
    """Step 1: every Triton launch of one policy interval of a one-layer cache, saved to ``path`` (torch.save)."""
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    from eval import host_overhead as ho
    from hfkv.attention.interface import hfkv_attention

    launches: list[dict[str, Any]] = []
    phase = ["step"]
    run = InterpretedFunction.run
    last: dict[str, tuple] = {}  # each kernel's previous arguments, uncloned: which are the same objects again

    def recorded(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        keep = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]  # as launched, before any write
        prev = last.get(fn.__name__, ())
        same = [i < len(prev) and a is prev[i] for i, a in enumerate(args)]
        last[fn.__name__] = args
        launches.append({"phase": phase[0], "module": fn.__module__, "name": fn.__name__, "args": keep,
                         "kwargs": dict(kwargs), "grid": tuple(grid), "same": same})  # fmt: skip
        if fn.__name__ in ho.DECODE_KERNELS:
            return None
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    cache, layer, info = ho.build_layer(context, batch, "llama-3.1-8b", "hfkv", budget)
    scaling = info["head_dim"] ** -0.5
    InterpretedFunction.run = recorded
    try:
        for k, v, q in ho.decode_inputs(batch, info, layer.cfg.interval):
            due = layer.policy.due(layer.steps_since_policy + 1, layer.window.count + 1, layer.length + 1)
            phase[0] = "policy_step" if due else "step"
            cache.update(k, v, 0)
            hfkv_attention(None, q, k, v, None, scaling=scaling)
    finally:
        InterpretedFunction.run = run
    if not any(x["phase"] == "policy_step" for x in launches):
        raise RuntimeError("launch_binding: no policy run in the recorded interval")
    torch.save({"launches": launches, "interval": layer.cfg.interval}, path)


def time_binding(path: Path, repeats: int) -> dict[str, Any]:
    """Step 2 (Triton 3.6 on the path): microseconds of binder + cache key per recorded launch, by kernel and step."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

    saved = torch.load(path, weights_only=False)
    backend = make_backend(GPUTarget("cuda", 90, 32))
    binders: dict[tuple[str, str], Any] = {}
    per: dict[tuple[str, str], list[float]] = {}
    args_of: dict[str, int] = {}
    for x in saved["launches"]:
        key = (x["module"], x["name"])
        if key not in binders:
            fn = getattr(importlib.import_module(x["module"]), x["name"])
            jit = JITFunction(getattr(fn, "fn", fn))
            binders[key] = create_function_from_signature(jit.signature, jit.params, backend)
        binder = binders[key]
        # launch options are not kernel arguments; the two options JITFunction.run adds before binding
        kwargs = {k: v for k, v in x["kwargs"].items() if k not in ("num_warps", "num_stages", "maxnreg")}
        kwargs |= {"debug": False, "instrumentation_mode": ""}
        memo: dict = {}
        bound, spec, options = binder(*x["args"], **kwargs)
        compute_cache_key(memo, spec, options)  # the key's memo is warm on every launch after a kernel's first
        t0 = time.perf_counter()
        for _ in range(repeats):
            bound, spec, options = binder(*x["args"], **kwargs)
            compute_cache_key(memo, spec, options)
            list(bound.values())  # what JITFunction.run hands the launcher
        per.setdefault((x["phase"], x["name"]), []).append(1e6 * (time.perf_counter() - t0) / repeats)
        args_of[x["name"]] = len(x["args"]) + len(x["kwargs"])
    interval = saved["interval"]
    bound = time_bound_sites(saved["launches"], backend, repeats)
    kernels = [
        {
            "phase": phase,
            "kernel": name,
            "arguments": args_of[name],
            "launches": len(us),
            "us_per_launch": statistics.median(us),
        }  # fmt: skip
        for (phase, name), us in sorted(per.items(), key=lambda kv: (kv[0][0], -statistics.median(kv[1])))
    ]
    steps = interval - 1  # the interval's plain steps, then the step that runs the policy
    plain = sum(k["us_per_launch"] * k["launches"] for k in kernels if k["phase"] == "step") / steps
    policy = sum(k["us_per_launch"] * k["launches"] for k in kernels if k["phase"] == "policy_step")
    decode = {k["kernel"] for k in kernels if k["phase"] == "step"}
    run_only = sum(k["us_per_launch"] * k["launches"] for k in kernels if k["phase"] == "policy_step"
                   and k["kernel"] not in decode)  # fmt: skip
    return {
        "triton": triton.__version__,
        "target": "cuda sm_90 (binder and cache key only: no device)",
        "repeats": repeats,
        "kernels": kernels,
        "us_per_layer_step": plain,
        "launches_per_layer_step": sum(k["launches"] for k in kernels if k["phase"] == "step") / steps,
        "us_per_policy_run": run_only,
        "launches_per_policy_run": sum(
            k["launches"] for k in kernels if k["phase"] == "policy_step" and k["kernel"] not in decode
        ),
        "us_policy_step": policy,
        "bound": bound,
    }


def time_bound_sites(launches: list[dict[str, Any]], backend: Any, repeats: int) -> dict[str, Any]:
    """Microseconds per launch of the plain steps' decode launches through hfkv's bound sites
    (hfkv.kernels.launch.KernelLaunch), on the same arguments: what replaces the binder and key above.

    A stand-in driver gives the CUDA target, device and stream, and a stand-in compiled kernel's launcher does
    nothing (the driver's launcher, which converts each argument in C, runs on both paths and is timed by neither).
    Each site is bound on its first launch; the timed calls cycle through the recorded launches with the arguments
    that were the same objects at every step (the plan's storage) shared and the others (query, new key and value,
    output) distinct, so each call checks those as it would in a step.
    """
    from triton.runtime.driver import driver

    import hfkv.kernels.launch as kl

    class Kernel:
        function, packed_metadata = 0, ()

        def launch_metadata(self, grid, stream, *args):
            return None

        def run(self, *args):
            return None

    class Driver:
        def get_current_target(self):
            return backend.target

        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 0

    saved = kl.interpreter_on, driver._active
    kl.interpreter_on = lambda: False  # this process imported the kernels' source under the interpreter flag
    driver.set_active(Driver())
    try:
        return _time_sites(launches, repeats, Kernel, kl)
    finally:
        kl.interpreter_on = saved[0]
        driver.set_active(saved[1])


def _time_sites(launches: list[dict[str, Any]], repeats: int, kernel_type: type, kl: Any) -> dict[str, Any]:
    from triton.runtime.jit import JITFunction

    per: dict[str, float] = {}
    calls: dict[str, list[tuple]] = {}
    shared: dict[str, list[bool]] = {}
    for x in launches:
        if x["phase"] != "step":
            continue
        name = x["name"]
        if name not in calls:  # the first: its site is bound on it
            shared[name], calls[name] = _shared(launches, name), [tuple(x["args"])]
            continue
        base = calls[name][0]
        calls[name].append(tuple(b if k else a for a, b, k in zip(x["args"], base, shared[name], strict=True)))
    sites = {}
    for x in launches:
        name = x["name"]
        if x["phase"] != "step" or name in sites:
            continue
        fn = getattr(importlib.import_module(x["module"]), name)
        jit = JITFunction(getattr(fn, "fn", fn))

        def compile_(key, signature, device, constexprs, options, attrs, warmup, jit=jit):
            jit.device_caches[device][0][key] = kernel = kernel_type()
            return kernel

        jit._do_compile = compile_
        site = sites[name] = kl.KernelLaunch(jit, x["grid"], x["kwargs"])
        args = calls[name]
        for a in args:
            site(*a)
        if site.triton_launches != 1:
            raise RuntimeError(f"launch_binding: the {name} site rebound ({site.triton_launches} Triton launches)")
        t0 = time.perf_counter()
        for _ in range(repeats):
            for a in args:
                site(*a)
        per[name] = 1e6 * (time.perf_counter() - t0) / (repeats * len(args))
    steps = len(calls["_partial_kernel"])
    kernels = [
        {
            "kernel": k,
            "us_per_launch": us,
            "launches": len(calls[k]),
            "arguments": len(calls[k][0]),
            "same_objects": sum(shared[k]),
        }  # fmt: skip
        for k, us in sorted(per.items(), key=lambda kv: -kv[1])
    ]
    return {
        "kernels": kernels,
        "us_per_layer_step": sum(k["us_per_launch"] * k["launches"] for k in kernels) / steps,
    }


def _shared(launches: list[dict[str, Any]], name: str) -> list[bool]:
    """Per argument of ``name``'s plain-step launches: the same object at every one of them after the first."""
    rows = [x["same"] for x in launches if x["phase"] == "step" and x["name"] == name][1:]
    return [all(r[i] for r in rows) for i in range(len(rows[0]))] if rows else []


def main(argv: list[str] | None = None) -> int:
    from hfkv import cli_args as ca
    from hfkv.evaluation import quiet

    ap = ca.ArgumentParser(prog="eval/launch_binding.py", description=__doc__.splitlines()[0], epilog=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--context", type=ca.integer(64), default=4096, help="prompt tokens held (default 4096)")
    ap.add_argument("--batch", type=ca.integer(1), default=8, help="rows (default 8)")
    ap.add_argument("--budget", type=ca.integer(1), default=1024, help="hfkv budget, fp_tokens per KV head (1024)")
    ap.add_argument("--repeats", type=ca.integer(1), default=400, help="timed bindings per launch (default 400)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="result file (default: %(default)s)")
    ap.add_argument("--triton-path", type=Path, default=AOT_TRITON, help="the Triton to time (default .aot-triton)")
    ap.add_argument("--time-only", type=Path, help=argparse.SUPPRESS)  # step 2, in the second process
    quiet.add_arguments(ap, default_threads="1")
    args = ap.parse_args(argv)
    if args.time_only:
        print(json.dumps(time_binding(args.time_only, args.repeats)))
        return 0
    if not (args.triton_path / "triton").is_dir():
        print(f"{ap.prog}: error: --triton-path={args.triton_path} holds no triton package (make aot-triton)",
              file=sys.stderr)  # fmt: skip
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        rec = Path(tmp) / "launches.pt"
        record(rec, args.context, args.batch, args.budget)
        try:
            status = quiet.start(args.threads, args.max_load, args.wait_quiet, args.force_busy)
        except ca.UsageError as exc:
            print(f"{ap.prog}: error: {exc}", file=sys.stderr)
            return 2
        path = os.pathsep.join([str(args.triton_path), str(REPO)])
        env = dict(os.environ) | {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "eval.launch_binding", "--time-only", str(rec), "--repeats", str(args.repeats)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        quiet.finish(status)
    from hfkv.evaluation.results import machine_name, provenance, script_command, write_result_json

    result = json.loads(out.strip().splitlines()[-1]) | {
        "what": "host microseconds of Triton's launch path (binder and cache key) for hfkv's kernels, by kernel, "
        "on the arguments a one-layer Llama-3.1-8B-shaped cache passes (eval/launch_binding.py docstring)",
        "context": args.context, "batch": args.batch, "budget": args.budget,
        "quiet": status, "busy": status["busy"], "command": script_command("eval/launch_binding.py", argv),
        **provenance(machine=machine_name()),
    }  # fmt: skip
    write_result_json(args.out, result)
    print(
        f"Triton {result['triton']}: {result['us_per_layer_step']:.1f} us a layer's step "
        f"({result['launches_per_layer_step']:g} launches), {result['us_per_policy_run']:.1f} us a policy run "
        f"({result['launches_per_policy_run']} launches); {quiet.describe(status)}{' BUSY' if status['busy'] else ''}"
        f"\nwrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
