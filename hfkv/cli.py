"""The ``hfkv`` command line: one subcommand per entry point, each in its own module.

Every subcommand checks its arguments before it loads a model (:mod:`hfkv.cli_args`); a bad one ends the
command with one line on stderr, ``hfkv <cmd>: error: <option>: <message>``, and exit status 2. An error
while running prints ``hfkv <cmd>: <message>`` and exits with 1. ``--debug`` (before or after the
subcommand) shows the traceback instead.

The parser is built for the subcommand being run only: ``hfkv --help`` and ``hfkv --version`` import no
subcommand module (nor torch, transformers, lm-eval or Optuna), ``hfkv <cmd> --help`` imports that command's
module alone, and each module imports its heavy dependencies when it runs. This module is the top floor: it
imports the subcommands' modules (by name, when one runs), none of them imports it; demo, bench and eval also
run as ``python -m <module>`` through :func:`hfkv.cli_args.command_main`, with the same parser, errors and exit
status.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable

from hfkv import __version__
from hfkv.cli_args import (
    COMMAND_HELP,
    DEBUG_HELP,
    ArgumentParser,
    add_options,
    exit_status,
    refuse_extra,
    run_parsed,
)

# subcommand -> (module, help). Modules expose add_arguments(parser) and run(args) -> int; those also run as
# `python -m <module>` have main(argv) = hfkv.cli_args.command_main(<subcommand>, add_arguments, run, argv).
SUBCOMMANDS = {
    "demo": ("hfkv.evaluation.demo", COMMAND_HELP["demo"]),
    "eval": ("hfkv.evaluation.lm_eval_cli", COMMAND_HELP["eval"]),
    "bench": ("hfkv.evaluation.bench", COMMAND_HELP["bench"]),
    "calibrate": ("hfkv.calibration.cli", COMMAND_HELP["calibrate"]),
    "train-gates": ("hfkv.calibration.gates_train", COMMAND_HELP["train-gates"]),
}


EPILOG = """\
exit status: 0 done; 2 bad arguments (one line on stderr naming the option, nothing was run);
1 an error while running (one line on stderr). --debug shows the traceback of either.
"""


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The ``hfkv`` parser. Every subcommand is listed, but only those of ``commands`` (default: all) get their
    options, because adding them imports the subcommand's module: :func:`main` passes the one it runs."""
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
            add_options(p, lambda parser, module=module: importlib.import_module(module).add_arguments(parser))
        p.add_argument("--debug", dest="_debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return parser


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


def main(argv: list[str] | None = None) -> int:
    """Run ``hfkv <argv>``; returns the exit status (``--help`` / ``--version`` exit through SystemExit)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = requested_command(argv)
    parser = build_parser([command] if command else [])
    prog = "hfkv"

    def work() -> int:
        nonlocal prog
        args, extra = parser.parse_known_args(argv)
        prog = f"hfkv {args.command}" if args.command else "hfkv"
        refuse_extra(_subparser(parser, args.command), extra, prog)
        if not args.command:
            parser.print_help()
            return 0
        # the subcommand's module, imported by name when it runs (the lazy per-subcommand loading above)
        return run_parsed(args, prog, lambda a: importlib.import_module(a._module).run(a))

    return exit_status(work, lambda: prog, debug="--debug" in argv)


if __name__ == "__main__":
    raise SystemExit(main())
