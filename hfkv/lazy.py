"""Public names of a package imported on first use (PEP 562).

``import hfkv`` and ``import hfkv.calibration`` must not load torch, transformers or Optuna: ``hfkv --help``,
``hfkv --version`` and a subcommand's ``--help`` answer at once, and only what a command runs is imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(
    package: str, names: dict[str, str], namespace: dict[str, Any], public: list[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``: a name of ``names`` (name -> defining module) is
    imported from its module when first asked for and kept in ``namespace``; any other public name is tried as a
    submodule, because code written when the package imported them eagerly may reach ``package.<submodule>``
    without importing it."""

    def __getattr__(name: str) -> Any:
        if name in names:
            value = getattr(importlib.import_module(names[name]), name)
            namespace[name] = value
            return value
        if not name.startswith("_"):
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*namespace, *public})

    return __getattr__, __dir__
