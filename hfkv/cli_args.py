"""Argument checking shared by the ``hfkv`` subcommands: one-line errors, validated lists and names.

Every subcommand checks its whole command line before it loads a model, builds data or runs a row.
The ``type=`` callables here turn one option's text into what the command uses (``"80,160"`` ->
``[80, 160]``) or refuse it; a refusal that needs several options (``diffkv`` at ``--budgets 48``) is a
:class:`UsageError` raised by the subcommand's own check before any work. :func:`exit_status` prints
either as one line, ``hfkv <cmd>: error: <option>: <message>``, and exits with status 2 (``--debug``:
with the traceback), for :func:`hfkv.cli.main` and for a subcommand run as ``python -m <module>``
(:func:`command_main`). Names close to a known one get a "did you mean" (presets, TriStateConfig fields,
tasks, choices).

This module is the vocabulary the applications share (``hfkv.evaluation``, ``hfkv.calibration``, ``hfkv.cli``
import it; it imports none of them). It sits above :mod:`hfkv.loading` and :mod:`hfkv.presets`, and imports them
only when a value is checked: ``hfkv --help`` builds its parser from this module without loading torch. A check
that needs an application's own vocabulary is that application's, passed in through :func:`validated` (method
specs: :data:`hfkv.evaluation.methods.method_specs`).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from hfkv.lazy import lazy_names
from hfkv.suggest import did_you_mean  # re-exported (__all__): torch-free, unlike hfkv.config

__all__ = [
    "BUDGETS_TEXT",
    "COMMAND_HELP",
    "DEBUG_HELP",
    "ArgumentParser",
    "UsageError",
    "add_options",
    "check_model",
    "command_main",
    "device",
    "did_you_mean",
    "dtype",
    "exit_status",
    "integer",
    "integer_list",
    "names",
    "one_of",
    "preset_or_yaml",
    "refuse_extra",
    "run_parsed",
    "split_list",
    "usage_from",
    "validated",
]


# PRESETS, kept for callers that read it here, on first use: hfkv.presets imports torch
__getattr__, __dir__ = lazy_names(__name__, {"PRESETS": "hfkv.presets"}, globals(), __all__)


#: What a ``--budgets`` value counts, for the help of every command that takes one: the presets differ
#: (``TriStateConfig.budget_unit``), so "token budgets" would be wrong for hfkv's.
BUDGETS_TEXT = (
    "budgets per KV head, each in its preset's unit: full-precision-token equivalents for hfkv (a memory budget: "
    "quantized tokens cost what they weigh), tokens kept for the other presets"
)


class UsageError(ValueError):
    """A bad command line: ``option`` (``--budgets``), what is wrong with its value and what is allowed."""

    def __init__(self, option: str | None, message: str, prog: str | None = None):
        self.option, self.message, self.prog = option, message, prog
        super().__init__(f"{option}: {message}" if option else message)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: :meth:`error` raises :class:`UsageError` (printed by ``hfkv.cli.main``,
    exit status 2) instead of printing the usage, and an invalid choice names the closest valid one."""

    def error(self, message: str):
        option = None
        if message.startswith("argument ") and ": " in message:
            option, message = message[len("argument ") :].split(": ", 1)
        raise UsageError(option, message, prog=self.prog)

    def parse_or_report(self, argv: Sequence[str] | None = None) -> argparse.Namespace | None:
        """``parse_args`` for a script's ``main``: a bad command line is printed on stderr as ``prog: error: ...``
        and gives None, for the script to return exit status 2."""
        try:
            return self.parse_args(argv)
        except UsageError as exc:
            print(f"{self.prog}: error: {exc}", file=sys.stderr)
            return None

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        choices = action.choices
        if choices is not None and value not in choices:
            shown = [str(c) for c in choices]
            raise argparse.ArgumentError(
                action, f"{value!r} is not one of {', '.join(shown)}{did_you_mean(str(value), shown)}"
            )


def usage_from(exc: BaseException, option: str | None = None) -> UsageError:
    """A :class:`UsageError` from a library error whose message starts with the option it is about
    (``"--range 'x=0:1': unknown parameter 'x'"``), else about ``option``."""
    m = re.match(r"(--[a-z0-9][a-z0-9_-]*)[=:]?\s*(.*)", str(exc), re.S)
    if m:
        return UsageError(m[1], m[2])
    return UsageError(option, str(exc))


def split_list(text: str | Iterable[str] | None) -> list[str]:
    """``"a,b c"`` or ``["a,b", "c"]`` -> ``["a", "b", "c"]`` (commas or spaces)."""
    if text is None:
        return []
    items = [text] if isinstance(text, str) else list(text)
    return [p.strip() for item in items for p in item.replace(" ", ",").split(",") if p.strip()]


def _named(fn: Callable, name: str) -> Callable:
    fn.__name__ = name  # argparse names the type in messages it writes itself
    return fn


def _int_range(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f"an integer from {low} to {high}"
    if low == 1:
        return "a positive integer"
    if low is not None:
        return f"an integer >= {low}"
    if high is not None:
        return f"an integer <= {high}"
    return "an integer"


def _to_int(text: str, low: int | None, high: int | None, whole: str | None = None) -> int:
    where = f" in {whole!r}" if whole is not None and whole.strip() != text.strip() else ""
    try:
        value = int(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}{where} is not {_int_range(low, high)}") from None
    if (low is not None and value < low) or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"{text!r}{where} must be {_int_range(low, high)}")
    return value


def integer(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """``type=`` for one integer in ``[low, high]``."""
    return _named(lambda text: _to_int(text, low, high), "integer")


def integer_list(
    low: int | None = 1,
    allow_none: bool = False,
    what: str = "integers",
    example: str = "80,160",
    allow_empty: bool = False,
) -> Callable[[str], list]:
    """``type=`` for comma-separated integers >= ``low`` (``"80,160"`` -> ``[80, 160]``); ``none`` -> None
    for an element when ``allow_none`` (budgets); ``""`` -> ``[]`` when ``allow_empty``."""

    def parse(text: str) -> list:
        parts = split_list(text)
        if not parts and allow_empty:
            return []
        if not parts:
            raise argparse.ArgumentTypeError(f"{text!r} is empty; give comma-separated {what}, e.g. {example}")
        out: list = []
        for part in parts:
            if allow_none and part.lower() in ("none", "null"):
                out.append(None)
                continue
            try:
                out.append(_to_int(part, low, None, text))
            except argparse.ArgumentTypeError as exc:
                extra = " or 'none'" if allow_none else ""
                raise argparse.ArgumentTypeError(f"{exc}{extra} (comma-separated {what}, e.g. {example})") from None
        return out

    return _named(parse, "integer list")


def names(
    choices: Sequence[str] | Callable[[], Sequence[str]], what: str, none: bool = False
) -> Callable[[str], list[str]]:
    """``type=`` for a comma-separated list of known names (``choices``, or a function giving them so a
    module is imported only when the option is used); ``none`` (when allowed) gives ``[]``."""

    def parse(text: str) -> list[str]:
        known = list(choices() if callable(choices) else choices)
        parts = split_list(text)
        if none and [p.lower() for p in parts] == ["none"]:
            return []
        if not parts:
            raise argparse.ArgumentTypeError(f"{text!r} is empty; {what}s: {', '.join(known)}")
        for part in parts:
            if part not in known:
                alt = ", or 'none'" if none else ""
                raise argparse.ArgumentTypeError(
                    f"{part!r} is not a {what}{did_you_mean(part, known)}; {what}s: {', '.join(known)}{alt}"
                )
        return parts

    return _named(parse, f"{what} list")


def one_of(choices: Sequence[str] | Callable[[], Sequence[str]], what: str) -> Callable[[str], str]:
    """``type=`` for one known name, with a did-you-mean (``choices`` as in :func:`names`)."""

    def parse(text: str) -> str:
        known = list(choices() if callable(choices) else choices)
        if text not in known:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a {what}{did_you_mean(text, known)}; {what}s: {', '.join(known)}"
            )
        return text

    return _named(parse, what)


def validated(check: Callable[[str], Any], name: str = "value") -> Callable[[str], str]:
    """``type=`` that runs ``check(text)`` (a ValueError refuses the value) and keeps the text as given."""

    def parse(text: str) -> str:
        try:
            check(text)
        except (ValueError, FileNotFoundError) as exc:
            msg = usage_from(exc).message  # without a leading "--option" (argparse names the option)
            raise argparse.ArgumentTypeError(msg if repr(text) in msg else f"{text!r}: {msg}") from None
        return text

    return _named(parse, name)


def _check_preset_or_yaml(text: str) -> None:
    from hfkv.presets import PRESETS  # when a value is checked: hfkv.presets imports torch (see the docstring)

    if text in PRESETS:
        return
    if text.endswith((".yaml", ".yml")):
        if not os.path.isfile(text):
            raise ValueError(f"config file {text!r} not found")
        return
    raise ValueError(
        f"{text!r} is not a preset{did_you_mean(text, PRESETS)} or a .yaml file; presets: {', '.join(PRESETS)}"
    )


#: ``type=`` for a preset name or an existing YAML config file (the text is kept).
preset_or_yaml = validated(_check_preset_or_yaml, "preset")


def dtype(allow_auto: bool = True) -> Callable[[str], str]:
    """``type=`` for a model dtype name (bf16, fp16, fp32, bfloat16, ...; ``auto`` when allowed); kept as text."""

    def parse(text: str) -> str:
        from hfkv.loading import _DTYPES  # when a value is checked: hfkv.loading imports torch

        known = [*_DTYPES, *(["auto"] if allow_auto else [])]
        if text not in known:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a dtype{did_you_mean(text, known)}; one of {', '.join(known)}"
            )
        return text

    return _named(parse, "dtype")


def device(allow_auto: bool = False) -> Callable[[str], str]:
    """``type=`` for a torch device (cpu, cuda, cuda:N, ...; ``auto`` when allowed); CUDA must be available."""

    def parse(text: str) -> str:
        if allow_auto and text == "auto":
            return text
        import torch  # when a value is checked (hfkv --help loads no torch)

        try:
            dev = torch.device(text)
        except (RuntimeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (cpu, cuda, cuda:N)") from None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available on this machine; use cpu")
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                raise argparse.ArgumentTypeError(
                    f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
                )
        return text

    return _named(parse, "device")


def check_model(option: str, spec: str, gguf_file: str | None = None) -> None:
    """:class:`UsageError` for a model spec that cannot load (:func:`hfkv.loading.check_model_spec`)."""
    from hfkv.loading import check_model_spec  # when a value is checked: hfkv.loading imports torch

    try:
        check_model_spec(spec, gguf_file)
    except ValueError as exc:
        raise UsageError(option, str(exc)) from None


# ------------------------------------------------------------------------------------------ running a command
DEBUG_HELP = "show the traceback of an error instead of one line"

#: Each subcommand's one-line help: ``hfkv --help`` lists them (:data:`hfkv.cli.SUBCOMMANDS`), and the
#: subcommand's own parser shows it, under ``hfkv <cmd>`` as under ``python -m <module>`` (:func:`command_main`).
COMMAND_HELP = {
    "demo": "run the testbed tasks with DynamicCache and each preset; print a table",
    "eval": "run lm-eval with the 'hfkv' model registered (all lm-eval options)",
    "bench": "memory and speed of presets and baselines, as ratios to DynamicCache",
    "calibrate": "Optuna study of alpha_h / alpha_l (and more) on MATH-style data",
    "train-gates": "distil learned retention gates (score_source='retention') from a frozen model, on CPU",
}


def add_options(parser: argparse.ArgumentParser, add_arguments: Callable[[argparse.ArgumentParser], None]) -> None:
    """A subcommand's options on its parser (``add_arguments(parser)``); when an optional extra is missing
    (ModuleNotFoundError) the parser keeps the message, for :func:`run_parsed` to say which when the command runs."""
    try:
        add_arguments(parser)
    except ModuleNotFoundError as exc:
        parser.set_defaults(_missing=str(exc))


def refuse_extra(parser: argparse.ArgumentParser, extra: list[str], prog: str) -> None:
    """:class:`UsageError` for arguments ``parser`` (a subcommand's) left over, with the closest of its options."""
    if extra:
        options = [o for a in parser._actions for o in a.option_strings]
        hint = did_you_mean(extra[0], options) if extra[0].startswith("-") else ""
        raise UsageError(None, f"unrecognized arguments: {' '.join(extra)}{hint}", prog=prog)


def run_parsed(args: argparse.Namespace, prog: str, run: Callable[[argparse.Namespace], int | None]) -> int:
    """``run(args)``'s exit status, or 2 with one line naming the missing extra (:func:`add_options`)."""
    if getattr(args, "_missing", None):
        print(f"{prog}: {args._missing}; install the matching extra (pip install 'hfkv[all]')", file=sys.stderr)
        return 2
    return int(run(args) or 0)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if not isinstance(exc, (ValueError, OSError, RuntimeError)):
        text = f"{type(exc).__name__}: {text}"
    return text


def exit_status(work: Callable[[], int], prog: Callable[[], str], debug: bool) -> int:
    """Run a command (``work()``: parse, check, run) and return its exit status, every error as one line on stderr
    under the name ``prog()`` gives at that moment: a :class:`UsageError` ``<prog>: error: <option>: <message>``
    and 2 (nothing was run), an error while running ``<prog>: <message>`` and 1, an interrupt 130. ``debug``
    (``--debug``) raises instead, for the traceback. ``--help`` exits through SystemExit, as argparse does."""
    try:
        return work()
    except UsageError as exc:
        if debug:
            raise
        print(f"{exc.prog or prog()}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog()}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as exc:
        if isinstance(exc.code, str) and not debug:  # raise SystemExit("message") inside a command
            print(f"{prog()}: {' '.join(exc.code.split())}", file=sys.stderr)
            return 1
        raise
    except Exception as exc:
        if debug:
            raise
        print(f"{prog()}: {_one_line(exc)} (--debug shows the traceback)", file=sys.stderr)
        return 1


def command_main(
    command: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int | None],
    argv: Sequence[str] | None = None,
) -> int:
    """``python -m <module> <argv>`` of a subcommand = ``hfkv <command> <argv>``: the parser ``hfkv <command>``
    gets (its options, ``--debug``, the same help), the same checks, errors and exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = f"hfkv {command}"
    parser = ArgumentParser(prog=prog, description=COMMAND_HELP[command])
    parser.set_defaults(command=command)  # as hfkv.cli's parser sets it: commands record their options
    add_options(parser, add_arguments)
    parser.add_argument("--debug", dest="_debug", action="store_true", help=DEBUG_HELP)

    def work() -> int:
        args, extra = parser.parse_known_args(argv)
        refuse_extra(parser, extra, prog)
        return run_parsed(args, prog, run)

    return exit_status(work, lambda: prog, debug="--debug" in argv)
