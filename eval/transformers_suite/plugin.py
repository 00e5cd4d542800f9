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

Encoder-decoder caches: under a compressing preset (any but ``full``) an ``EncoderDecoderCache`` whose
cross-attention half is a substitute gets the plain DynamicCache of the same arguments there instead, as a user of
hfkv writes ``EncoderDecoderCache(TriStateCache(model, "hfkv"), DynamicCache())`` (``_uncompressed_cross_attention``).

Selection: ``--hfkv-only FILE`` deselects every test whose node id FILE does not list (run.py's ``--only-exercised``).

Also, always: transformers' test modules load ``<repo>/src/transformers`` with ``direct_transformers_import``, a path
the vendored tree does not have; where that path is missing the installed ``transformers`` is returned instead.
"""

from __future__ import annotations

import functools
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
                ddp_cache_data = list(ddp_cache_data or ())  # read twice: here and by _plain_twin
                TriStateCache.__init__(
                    self, config, preset, offloading=offloading, offload_only_non_sliding=offload_only_non_sliding
                )
                for i, kv in enumerate(ddp_cache_data):
                    if kv[0] is not None and kv[1] is not None:  # None: a KV-sharing layer, kept empty
                        self.update(kv[0], kv[1], i)
                # what DynamicCache was asked for, and the length that gave: _uncompressed_cross_attention's
                self._suite_args = (ddp_cache_data, config, offloading, offload_only_non_sliding)
                self._suite_built_length = self.get_seq_length()

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
    if substitute is not None and preset != "full":
        _uncompressed_cross_attention(substitute)


def _plain_twin(cache: Any) -> Any:
    """The DynamicCache that ``cache`` (a substitute) stands for: built from the same arguments, not substituted.

    ``object.__new__`` and ``DynamicCache.__init__`` directly, past the patched ``__new__``: no substitution, and not
    counted again in ``hfkv_caches`` (the construction was counted once, when the substitute was built)."""
    from transformers.cache_utils import DynamicCache

    ddp_cache_data, config, offloading, offload_only_non_sliding = cache._suite_args
    twin = object.__new__(DynamicCache)
    DynamicCache.__init__(
        twin, ddp_cache_data or None, config, offloading=offloading, offload_only_non_sliding=offload_only_non_sliding
    )
    return twin


def _uncompressed_cross_attention(substitute: type) -> None:
    """Under a compressing preset, an EncoderDecoderCache's cross-attention half stays a plain DynamicCache.

    hfkv compresses decoder self-attention: its scores assume causal queries over the keys they are stored with, and
    the cross-attention half holds the encoder's keys, queried by every decoder token (non-causal, query and key
    lengths differ). A user of an encoder-decoder model writes ``EncoderDecoderCache(TriStateCache(model, "hfkv"),
    DynamicCache())``; this does the same where transformers writes ``EncoderDecoderCache(DynamicCache(**kw),
    DynamicCache(**kw))`` (generate, bart's forward): a substituted cross-attention half is replaced by the plain
    DynamicCache built from the same arguments (``_plain_twin``), not by ``TriStateCache(config, "full")``, because
    that is what the user's code has there, so the run tests only the half that hfkv changes. The self-attention
    half stays substituted. ``EncoderDecoderCache.__init__(*caches)`` (transformers 5.23.0: positional only, no
    ``from_legacy_cache``) takes the two halves, or one iterable of DDP tuples that it splits into two
    ``DynamicCache(data)``; both paths end in ``self.cross_attention_cache``, so the original ``__init__`` runs
    first and, if that half is a substitute, runs again with ``(self_attention_cache, twin)``, which recomputes
    ``is_updated`` the library's way. A substitute that was updated after it was built (its length is not the one its
    arguments gave) is left as it is: its keys may be compressed already and cannot be rebuilt; no vendored test
    does that (generate and the models wrap fresh caches)."""
    from transformers.cache_utils import EncoderDecoderCache

    original = EncoderDecoderCache.__init__
    if getattr(original, "_hfkv_suite", False):  # pytest_configure ran twice in this process
        original = original.__wrapped__  # type: ignore[attr-defined]

    @functools.wraps(original)
    def __init__(self: Any, *caches: Any) -> None:
        original(self, *caches)
        cross = self.cross_attention_cache
        if type(cross) is substitute and cross.get_seq_length() == cross._suite_built_length:
            original(self, self.self_attention_cache, _plain_twin(cross))

    __init__._hfkv_suite = True  # type: ignore[attr-defined]
    EncoderDecoderCache.__init__ = __init__  # type: ignore[method-assign]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--hfkv-report", default=None, help="write every test's outcome to this JSON file")
    parser.addoption("--hfkv-only", default=None, help="a file of node ids, one a line: deselect every other test")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--hfkv-only FILE``: keep the tests whose node ids FILE lists (run.py's ``--only-exercised``).

    Node ids go through a file, not the command line: no length limit, and parametrized ids (brackets, spaces,
    quotes) need no escaping. Each xdist worker deselects the same way, so their collections agree."""
    path = config.getoption("--hfkv-only")
    if not path:
        return
    wanted = set(Path(path).read_text().splitlines())
    keep = [item for item in items if item.nodeid in wanted]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in wanted])
        items[:] = keep


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
