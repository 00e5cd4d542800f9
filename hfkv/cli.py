"""The ``hfkv`` command line: one subcommand per entry point, each in its own module."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help). Modules expose add_arguments(parser) and run(args) -> int.
SUBCOMMANDS = {
    "demo": ("hfkv.testbed.demo", "run the testbed tasks with DynamicCache and each preset; print a table"),
    "eval": ("hfkv.evaluation.lm_eval_cli", "run lm-eval with the 'hfkv' model registered (all lm-eval options)"),
    "bench": ("hfkv.evaluation.bench", "memory and speed of presets and baselines, as ratios to DynamicCache"),
    "calibrate": ("hfkv.calibration.cli", "Optuna study of alpha_h / alpha_l (and more) on MATH-style data"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hfkv", description="Tri-state KV cache for Hugging Face transformers")
    parser.add_argument("--version", action="version", version=f"hfkv {importlib.import_module('hfkv').__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as exc:  # an optional extra is missing: say which
            p.set_defaults(_missing=str(exc))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 0
    if getattr(args, "_missing", None):
        print(
            f"hfkv {args.command}: {args._missing}; install the matching extra (pip install 'hfkv[all]')",
            file=sys.stderr,
        )
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
