"""``hfkv demo``: accuracy vs KV memory of the presets on the shipped testbed.

Loads the testbed model (``hfkv.testbed.TESTBED_PATH``), runs each task's shipped test set
(``--limit`` examples per task) with greedy generation, first with a plain ``DynamicCache``, then
with each preset of ``--presets`` at each budget of ``--budgets`` (a fresh ``TriStateCache`` per
``generate`` call), and prints one row per (task, cache): exact-match accuracy, compression ratio
(KV bytes a DynamicCache would hold for the same tokens / KV bytes held) and decode tokens/s.
``--presets none`` runs only the DynamicCache rows. It writes nothing unless ``--out`` names a file.

Decode tok/s compare rows only when nothing else ran: the rows are measured one after another, so another
process starting halfway makes later rows look slow, or a finished one fast. :class:`LoadWatch` applies
``hfkv bench``'s quiet rule without its waits (:mod:`hfkv.evaluation.quiet`): the 1-minute load average must be
below 0.5 before the run and stay within what the run's own threads explain after every row; otherwise the
speed column is printed marked as not comparable, with the reason.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from collections.abc import Callable

import torch

import hfkv
from hfkv import cli_args as ca
from hfkv.atomic import write_atomic
from hfkv.config import TriStateConfig
from hfkv.evaluation import quiet
from hfkv.loading import parse_dtype
from hfkv.presets import PRESETS
from hfkv.testbed import TESTBED_PATH
from hfkv.testbed import tasks as testbed_tasks  # read when called (tests replace load_test_set)
from hfkv.testbed.protocol import evaluate

DEFAULT_PRESETS = "evict,quant,streaming,arkv,diffkv,hfkv"
DEFAULT_BUDGETS = "80,160"


def _task_names() -> list[str]:
    return list(testbed_tasks.TASKS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: the shipped testbed)")
    parser.add_argument(
        "--tasks",
        type=ca.names(_task_names, "task"),
        default=None,
        help="comma-separated testbed task names (default: all testbed tasks)",
    )
    parser.add_argument(
        "--limit", type=ca.integer(1), default=100, help="examples per task (default: 100, the whole test set)"
    )
    parser.add_argument(
        "--presets",
        type=ca.names(PRESETS, "preset", none=True),
        default=DEFAULT_PRESETS,
        help=f"comma-separated presets ({', '.join(PRESETS)}), or 'none' for the DynamicCache rows only "
        f"(default: {DEFAULT_PRESETS})",
    )
    parser.add_argument(
        "--budgets",
        type=ca.integer_list(1, what="budgets"),
        default=DEFAULT_BUDGETS,
        help=f"comma-separated {ca.BUDGETS_TEXT}; each preset runs at each (default: {DEFAULT_BUDGETS})",
    )
    parser.add_argument(
        "--batch-size", type=ca.integer(1), default=25, help="prompts per generate call (left padding; default 25)"
    )
    parser.add_argument("--threads", type=ca.integer(0), default=0, help="torch CPU threads (0: leave as is)")
    parser.add_argument(
        "--device", type=ca.device(), default="cpu", help="torch device of the model: cpu (default), cuda, cuda:N"
    )
    parser.add_argument(
        "--dtype",
        type=ca.dtype(allow_auto=False),
        default="fp32",
        help="model and cache dtype: fp32 (default: what a CPU without bf16 units runs fastest), bf16, fp16",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="also write the rows and how the run went (time, threads, load) to this JSON (default: nothing is "
        "written; the committed run eval/results/demo.json comes from `make results-demo`)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def check_args(args) -> tuple[str, list[str], list[str], list[int]]:
    """``(model path, tasks, presets, budgets)`` of a checked command line; :class:`hfkv.cli_args.UsageError`
    on a bad one (a missing model, an unknown task or preset, a preset refusing a budget). Loads nothing."""

    def listed(value, parse):  # parsed by add_arguments' types, or a string from a caller of run()
        return parse(value) if isinstance(value, str) else list(value)

    path = args.model or TESTBED_PATH
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ca.UsageError(
            "--model",
            f"no model at {path!r} (expected config.json, safetensors and tokenizer files); the testbed ships in "
            "hfkv/testbed/model, or train one with `python -m hfkv.testbed.train`",
        )
    tasks = listed(args.tasks, ca.names(_task_names, "task")) if args.tasks else _task_names()
    presets = listed(args.presets, ca.names(PRESETS, "preset", none=True))
    budgets = listed(args.budgets, ca.integer_list(1, what="budgets"))
    for name in presets:
        for b in budgets:
            try:
                TriStateConfig.from_preset(name, budget=b)
            except ValueError as exc:
                raise ca.UsageError("--presets/--budgets", f"{name}@{b}: {exc}") from None
    return path, tasks, presets, budgets


class LoadWatch:
    """Whether other processes shared the machine during the run, from the 1-minute load average.

    ``hfkv bench`` refuses a busy machine and waits for its own load to decay before the check after the run;
    the demo is about accuracy and must not wait, so it marks the speed column instead. Before: the load must be
    below ``max_load``. During (after every row): a run keeping ``threads`` threads busy lifts the average from
    ``L0`` to at most ``L0 e^(-t/60) + threads (1 - e^(-t/60))`` after ``t`` seconds (the kernel's smoothing);
    a load more than ``max_load`` above that means another process ran."""

    def __init__(self, threads: int, max_load: float | None = None, clock: Callable[[], float] = time.perf_counter):
        self._quiet, self._clock = quiet, clock
        self.threads = max(1, int(threads))
        self.max_load = quiet.DEFAULT_MAX_LOAD if max_load is None else float(max_load)
        self.before = quiet.load_average()
        self.last: float | None = self.before
        self.worst: tuple[float, float] | None = None  # (load, excess over what the run explains), largest excess
        self._start = clock()

    def explained(self, seconds: float) -> float:
        """The highest 1-minute load this run alone can produce ``seconds`` after it started."""
        decay = math.exp(-max(0.0, seconds) / 60.0)
        return (self.before or 0.0) * decay + self.threads * (1.0 - decay)

    def sample(self) -> None:
        """Read the load now (after a row) and keep the largest excess over :meth:`explained`."""
        load = self._quiet.load_average()
        self.last = load
        if load is None or self.before is None:
            return
        excess = load - self.explained(self._clock() - self._start)
        if self.worst is None or excess > self.worst[1]:
            self.worst = (load, excess)

    def note(self) -> str | None:
        """Why the rows' decode tok/s are not comparable (None: they are)."""
        if self.before is None:
            return "no load average on this platform to tell whether other processes shared the cores"
        if self.before >= self.max_load:
            return (
                f"the 1-minute load average was {self.before:.2f} before the run, not below {self.max_load:g}: "
                "other processes shared the cores"
            )
        if self.worst is not None and self.worst[1] > self.max_load:
            load, excess = self.worst
            return (
                f"the load reached {load:.2f} during the run, {excess:.2f} above what its {self.threads} torch "
                "thread(s) explain: another process ran"
            )
        return None

    def record(self) -> dict:
        """The loads and the verdict, for the ``--out`` file."""
        note = self.note()
        worst = self.worst[0] if self.worst else None
        return {
            "max_load": self.max_load,
            "load_average_before": None if self.before is None else round(self.before, 2),
            "load_average_after": None if self.last is None else round(self.last, 2),
            "load_average_worst": None if worst is None else round(worst, 2),
            "speed_comparable": note is None,
            "speed_note": note,
        }


def run(args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path, task_names, presets, budgets = check_args(args)  # before anything is loaded
    from transformers import AutoModelForCausalLM, AutoTokenizer  # when it runs: `hfkv demo --help` stays quick

    if args.threads:
        torch.set_num_threads(args.threads)
    # before the model loads: the load of other processes (this one's own is explained from here on)
    watch = LoadWatch(torch.get_num_threads() if torch.device(args.device).type == "cpu" else 1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(getattr(args, "dtype", "fp32")))
    model = model.to(args.device)
    model.eval()
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"

    configs: list[tuple[str, str | None, int | None]] = [("DynamicCache", None, None)]
    configs += [(f"{name}@{b}", name, b) for name in presets for b in budgets]

    from tqdm.auto import tqdm  # as transformers

    dtype = str(model.dtype).removeprefix("torch.")
    print(
        f"hfkv demo: {'the testbed' if args.model is None else path} model, {dtype}, {args.device}, "
        f"{torch.get_num_threads()} torch threads; {len(task_names)} tasks x {len(configs)} caches x "
        f"{args.limit} examples. decode tok/s: measured after a warm-up, indicative of this machine only.",
        flush=True,
    )
    started = time.perf_counter()
    rows = []
    bar = tqdm(
        total=sum(min(args.limit, len(testbed_tasks.load_test_set(t))) for t in task_names) * len(configs),
        desc="demo",
        unit="ex",
        disable=args.no_progress,
    )
    for task_name in task_names:
        data = testbed_tasks.load_test_set(task_name)[: args.limit]
        for label, preset, budget in configs:
            bar.set_postfix_str(f"{task_name} {label}")
            r = evaluate(model, tok, task_name, data, preset, budget, batch_size=args.batch_size, bar=bar)
            rows.append({"task": task_name, "cache": label, **r})
            watch.sample()
    bar.close()
    wall = time.perf_counter() - started
    print(format_table(rows, speed_note=watch.note()))
    print(f"{wall / 60:.1f} min")
    if getattr(args, "out", None):
        run_info = {
            "options": {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "out"},
            "hfkv": hfkv.__version__,
            "torch": torch.__version__,
            "dtype": dtype,
            "device": args.device,
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "machine": platform.processor() or platform.machine(),
            **watch.record(),
            "wall_s": round(wall, 1),
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
        }
        write_atomic(args.out, json.dumps({"run": run_info, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


def format_table(rows: list[dict], speed_note: str | None = None) -> str:
    """The demo's table; eval/make_tables.py renders README's copy of a committed run with it. ``speed_note``
    (:meth:`LoadWatch.note`): the speed column's header gets a ``*`` and the note follows the table, so a
    reader does not compare speeds measured while something else ran."""
    speed_head = "decode tok/s*" if speed_note else "decode tok/s"
    header = (
        f"{'task':<10} {'cache':<16} {'n':>4} {'accuracy':>9} {'compression':>12} {'KV KiB/ex':>10} {speed_head:>13}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        speed = r["decode_tok_s"]
        speed = f"{speed:>13.1f}" if speed == speed else f"{'-':>13}"  # NaN: no decode step happened
        lines.append(
            f"{r['task']:<10} {r['cache']:<16} {r['n']:>4} {r['accuracy']:>9.3f} {r['compression']:>11.2f}x "
            f"{r['kv_kib']:>10.1f} {speed}"
        )
    if speed_note:
        lines.append(f"* decode tok/s not comparable between rows: {speed_note} (run it alone on the machine)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m hfkv.evaluation.demo ...`` = ``hfkv demo ...`` (same checks and errors)."""
    return ca.command_main("demo", add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
