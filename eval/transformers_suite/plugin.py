"""pytest plugin (``-p eval.transformers_suite.plugin``): DynamicCache -> TriStateCache, and one JSON of outcomes.

Substitution: with ``HFKV_SUITE_PRESET`` set (``full``, ``hfkv``, ``evict``, ...), every ``DynamicCache(...)``
construction, by a test or by transformers itself (``generate``, a model's forward), returns a TriStateCache of that
preset. ``DynamicCache.__new__`` hands back an instance of ``_Substitute``, a TriStateCache subclass with
DynamicCache's ``__init__`` signature; since it is a DynamicCache subclass, Python then runs its ``__init__`` with the
caller's arguments, and ``isinstance(cache, DynamicCache)`` stays true. Subclasses of DynamicCache (TriStateCache
itself, MtpCache, ...) are built as they are. Without the variable (the baseline) nothing is substituted.

Recording: each test's report carries ``hfkv_caches``, how many DynamicCaches were built during it (substituted ones
under a preset): a test with 0 never exercised the cache. With ``--hfkv-report PATH`` the controlling process
(xdist's too) writes every test's outcome, first message line and that count to PATH, atomically.

Also, always: transformers' test modules load ``<repo>/src/transformers`` with ``direct_transformers_import``, a path
the vendored tree does not have; where that path is missing the installed ``transformers`` is returned instead.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import pytest

PRESET_ENV = "HFKV_SUITE_PRESET"
COUNT_KEY = "hfkv_caches"
_built = 0  # DynamicCaches built since the current test's setup began (this process)


def _patch_direct_import() -> None:
    import transformers.utils as tu
    import transformers.utils.import_utils as iu

    original = iu.direct_transformers_import

    def direct_transformers_import(path: str, file: str = "__init__.py") -> Any:
        if not os.path.exists(os.path.join(path, file)):
            return importlib.import_module("transformers")
        return original(path, file)

    tu.direct_transformers_import = iu.direct_transformers_import = direct_transformers_import


def install(preset: str | None) -> None:
    """Count every DynamicCache construction; with ``preset``, also build a TriStateCache(preset) in its place."""
    from transformers.cache_utils import DynamicCache

    substitute: type | None = None
    if preset:
        from hfkv import TriStateCache

        class _Substitute(TriStateCache):
            """A TriStateCache built from DynamicCache's arguments."""

            def __init__(
                self,
                ddp_cache_data: Any = None,
                config: Any = None,
                offloading: bool = False,
                offload_only_non_sliding: bool = False,
            ) -> None:
                TriStateCache.__init__(
                    self, config, preset, offloading=offloading, offload_only_non_sliding=offload_only_non_sliding
                )
                for i, kv in enumerate(ddp_cache_data or ()):
                    if kv[0] is not None and kv[1] is not None:  # None: a KV-sharing layer, kept empty
                        self.update(kv[0], kv[1], i)

        _Substitute.__name__ = _Substitute.__qualname__ = f"TriStateCache[{preset}]"
        substitute = _Substitute

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        global _built
        if cls is DynamicCache:
            _built += 1
            if substitute is not None:
                return object.__new__(substitute)
        return object.__new__(cls)

    DynamicCache.__new__ = staticmethod(__new__)  # type: ignore[method-assign,assignment]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--hfkv-report", default=None, help="write every test's outcome to this JSON file")


def pytest_configure(config: pytest.Config) -> None:
    _patch_direct_import()
    install(os.environ.get(PRESET_ENV) or None)
    path = config.getoption("--hfkv-report")
    if path and not hasattr(config, "workerinput"):  # the controller: where xdist's workers' reports arrive
        config.pluginmanager.register(_Recorder(Path(path)), "hfkv-suite-recorder")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    global _built
    _built = 0


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> None:
    """Before each phase's report is made from the item: the count so far goes into its user_properties."""
    item.user_properties[:] = [p for p in item.user_properties if p[0] != COUNT_KEY] + [(COUNT_KEY, _built)]


def _message(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The first line that says why: a skip's reason, a failure's exception line."""
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple):  # a skip: (path, line, "Skipped: reason")
        text = str(longrepr[2])
    else:
        crash = getattr(longrepr, "reprcrash", None)
        text = crash.message if crash is not None else str(longrepr).strip().splitlines()[-1]
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first[:400]


class _Recorder:
    """Folds each test's setup/call/teardown reports into one outcome; writes them all at the session's end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tests: dict[str, dict[str, Any]] = {}
        self.start = time.time()

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:  # a file that cannot be imported: its tests never appear, the file does as an error
            self.tests[report.nodeid] = {"outcome": "error", "message": _message(report), COUNT_KEY: 0}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        rec = self.tests.setdefault(report.nodeid, {"outcome": None, "message": "", COUNT_KEY: 0, "duration": 0.0})
        rec[COUNT_KEY] = max(rec[COUNT_KEY], dict(report.user_properties).get(COUNT_KEY, 0))
        rec["duration"] = round(rec["duration"] + report.duration, 3)
        if report.when == "call":
            if hasattr(report, "wasxfail"):
                rec["outcome"] = "xfailed" if report.skipped else "xpassed"
            else:
                rec["outcome"] = report.outcome
            rec["message"] = _message(report)
        elif report.failed and rec["outcome"] in (None, "passed"):  # setup or teardown failed
            rec["outcome"], rec["message"] = "error", f"[{report.when}] {_message(report)}"
        elif report.when == "setup" and report.skipped:
            rec["outcome"], rec["message"] = "skipped", _message(report)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        from transformers import __version__ as tf_version

        from hfkv.atomic import write_atomic

        counts: dict[str, int] = {}
        for rec in self.tests.values():
            counts[rec["outcome"]] = counts.get(rec["outcome"], 0) + 1
        data = {
            "preset": os.environ.get(PRESET_ENV) or "none",
            "transformers": tf_version,
            "python": platform.python_version(),
            "wall_s": round(time.time() - self.start, 1),
            "counts": dict(sorted(counts.items())),
            "tests": dict(sorted(self.tests.items())),
        }
        write_atomic(self.path, json.dumps(data, indent=1) + "\n")
