"""The ``hfkv`` command line: one subcommand per entry point, each in its own module.

Every subcommand checks its arguments before it loads a model (:mod:`hfkv.cli_args`); a bad one ends the
command with one line on stderr, ``hfkv <cmd>: error: <option>: <message>``, and exit status 2. An error
while running prints ``hfkv <cmd>: <message>`` and exits with 1. ``--debug`` (before or after the
subcommand) shows the traceback instead.

The parser is built for the subcommand being run only: ``hfkv --help`` and ``hfkv --version`` import no
subcommand module (nor torch, transformers, lm-eval or Optuna), ``hfkv <cmd> --help`` imports that command's
module alone, and each module imports its heavy dependencies when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable

from hfkv.cli_args import ArgumentParser, UsageError, did_you_mean

# subcommand -> (module, help). Modules expose add_arguments(parser) and run(args) -> int.
SUBCOMMANDS = {
    "demo": ("hfkv.testbed.demo", "run the testbed tasks with DynamicCache and each preset; print a table"),
    "eval": ("hfkv.evaluation.lm_eval_cli", "run lm-eval with the 'hfkv' model registered (all lm-eval options)"),
    "bench": ("hfkv.evaluation.bench", "memory and speed of presets and baselines, as ratios to DynamicCache"),
    "calibrate": ("hfkv.calibration.cli", "Optuna study of alpha_h / alpha_l (and more) on MATH-style data"),
}


EPILOG = """\
exit status: 0 done; 2 bad arguments (one line on stderr naming the option, nothing was run);
1 an error while running (one line on stderr). --debug shows the traceback of either.
"""
DEBUG_HELP = "show the traceback of an error instead of one line"


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The ``hfkv`` parser. Every subcommand is listed, but only those of ``commands`` (default: all) get their
    options, because adding them imports the subcommand's module: :func:`main` passes the one it runs."""
    from hfkv import __version__

    wanted = set(SUBCOMMANDS if commands is None else commands)
    parser = ArgumentParser(
        prog="hfkv",
        description="Tri-state KV cache for Hugging Face transformers",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"hfkv {__version__}")
    parser.add_argument("--debug", dest="_debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if name in wanted:
            _add_options(p, module)
        p.add_argument("--debug", dest="_debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return parser


def _add_options(parser: argparse.ArgumentParser, module: str) -> None:
    try:
        importlib.import_module(module).add_arguments(parser)
    except ModuleNotFoundError as exc:  # an optional extra is missing: say which when the command runs
        parser.set_defaults(_missing=str(exc))


def requested_command(argv: list[str]) -> str | None:
    """The subcommand ``argv`` runs, read before parsing (the top-level options take no value): the first word
    that is not an option, if it names a subcommand. None after ``--help`` or ``--version``, which answer first."""
    for word in argv:
        if word in ("--", "-h", "--help", "--version"):
            return None
        if not word.startswith("-"):
            return word if word in SUBCOMMANDS else None
    return None


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if not isinstance(exc, (ValueError, OSError, RuntimeError)):
        text = f"{type(exc).__name__}: {text}"
    return text


def main(argv: list[str] | None = None) -> int:
    """Run ``hfkv <argv>``; returns the exit status (``--help`` / ``--version`` exit through SystemExit)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    command = requested_command(argv)
    parser = build_parser([command] if command else [])
    prog = "hfkv"
    try:
        args, extra = parser.parse_known_args(argv)
        command = args.command
        prog = f"hfkv {command}" if command else "hfkv"
        if extra:
            sub = _subparser(parser, command)
            options = [o for a in sub._actions for o in a.option_strings]
            hint = did_you_mean(extra[0], options) if extra[0].startswith("-") else ""
            raise UsageError(None, f"unrecognized arguments: {' '.join(extra)}{hint}", prog=prog)
        if not command:
            parser.print_help()
            return 0
        if getattr(args, "_missing", None):
            print(f"{prog}: {args._missing}; install the matching extra (pip install 'hfkv[all]')", file=sys.stderr)
            return 2
        return int(importlib.import_module(args._module).run(args) or 0)
    except UsageError as exc:
        if debug:
            raise
        print(f"{exc.prog or prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as exc:
        if isinstance(exc.code, str) and not debug:  # raise SystemExit("message") inside a command
            print(f"{prog}: {' '.join(exc.code.split())}", file=sys.stderr)
            return 1
        raise
    except Exception as exc:
        if debug:
            raise
        print(f"{prog}: {_one_line(exc)} (--debug shows the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
