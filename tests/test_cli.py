"""The console script: `hfkv --help` and subcommand discovery work without optional extras."""

from __future__ import annotations

import subprocess
import sys

from hfkv.cli import SUBCOMMANDS, build_parser, main


def test_help_lists_subcommands(capsys):
    try:
        main(["--help"])
    except SystemExit as exc:
        assert exc.code == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out


def test_no_command_prints_help(capsys):
    assert main([]) == 0
    assert "usage: hfkv" in capsys.readouterr().out


def test_module_entry_point_runs():
    res = subprocess.run([sys.executable, "-m", "hfkv.cli", "--version"], capture_output=True, text=True, check=False)
    assert res.returncode == 0 and "hfkv" in res.stdout


def test_demo_parser_has_documented_options():
    args = build_parser().parse_args(["demo", "--presets", "none", "--limit", "1"])
    assert args.command == "demo" and args.limit == 1
