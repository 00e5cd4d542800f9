"""Importing a script of ``eval/`` (not a package) as a module, for the tests of its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load(name: str):
    """``eval/<name>.py`` as the module ``name`` (registered in ``sys.modules``, as its dataclasses need)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "eval" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
