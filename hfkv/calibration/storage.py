"""Where a study lives and how workers share it without losing or duplicating a trial.

Storage: an SQLite file under ``hfkv-out/calibrate/studies/`` (relative to the working directory) by
default (re-running the same command resumes), any Optuna RDB URL (PostgreSQL for many machines), or an
Optuna journal file. The default is the user's folder, never ``calibration/studies/``: a run must not
write next to the committed studies unless it names them.

Exactly ``n_trials`` finished trials, whatever the number of workers: a worker creates a trial
only while holding a study-wide lock (a file lock next to an SQLite/journal file, a PostgreSQL or
MySQL advisory lock for servers), after counting finished + running + queued trials. Optuna's own
``MaxTrialsCallback`` counts without a lock, so two workers finishing together overshoot.

Liveness: each running trial carries a ``heartbeat`` (unix time) that its worker refreshes every
``heartbeat_interval`` seconds. A trial whose heartbeat is older than ``grace_period`` belonged to
a killed worker: it is marked FAIL and re-queued with the same parameters (at most ``max_retry``
times), so a SIGKILL costs one trial's work and nothing finished. Optuna's built-in heartbeat
exists for RDB storages only (not journal files), hence this small, storage-agnostic version;
it compares wall clocks of different machines, so keep the grace period well above their skew.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import re
import socket
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.trial import TrialState

DEFAULT_DIR = Path("hfkv-out/calibrate/studies")  # hfkv.calibration.cli.STUDIES_DIR
JOURNAL_SUFFIXES = (".log", ".journal", ".jsonl")
HEARTBEAT = "heartbeat"
WORKER = "worker"
INHERITED = ("base_point",)  # user attributes a retry keeps (hfkv.calibration.search.BASE_POINT)


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def redact(url: str) -> str:
    """The storage URL without its password, for logs, summaries and config provenance."""
    return re.sub(r"(://[^:/@]+):[^@/]*@", r"\1:***@", url)


@dataclass
class Storage:
    """An opened storage, how to describe it, and the lock that serialises trial creation."""

    storage: optuna.storages.BaseStorage
    url: str  # as given (may hold a password: never print it, use .public)
    kind: str  # "sqlite" | "rdb" | "journal"
    lock_key: str

    @property
    def public(self) -> str:
        return redact(self.url)

    def lock(self):
        """A context manager held across processes and machines sharing this storage (not re-entrant)."""
        key = self.lock_key
        if self.kind in ("sqlite", "journal"):
            path = self._file_path()
            if path is None:  # in-memory SQLite: one process
                return threading.Lock()
            import filelock  # optional: filelock, the [calibrate] extra

            return filelock.FileLock(f"{path}.hfkv-lock")  # one per file; never held twice at once
        engine = self.storage.engine
        dialect = engine.dialect.name
        if dialect == "postgresql":
            return _advisory(engine, "SELECT pg_advisory_lock(:k)", "SELECT pg_advisory_unlock(:k)", _int64(key))
        if dialect in ("mysql", "mariadb"):
            return _advisory(engine, "SELECT GET_LOCK(:k, -1)", "SELECT RELEASE_LOCK(:k)", key[:64])
        warnings.warn(
            f"--storage {self.public}: no cross-process lock for the {dialect!r} dialect; with several workers "
            "the study may end with a trial or two more than --n-trials",
            stacklevel=2,
        )
        return contextlib.nullcontext()

    def _file_path(self) -> str | None:
        if self.kind == "journal":
            return self.url
        path = self.url.split(":///", 1)[1] if ":///" in self.url else ""
        return None if path in ("", ":memory:") else path


def _int64(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big", signed=True)


@contextlib.contextmanager
def _advisory(engine, acquire: str, release: str, key):
    from sqlalchemy import text  # deferred: sqlalchemy (with optuna) only for database storages

    with engine.connect() as conn:
        conn.execute(text(acquire), {"k": key})
        conn.commit()
        try:
            yield
        finally:
            conn.execute(text(release), {"k": key})
            conn.commit()


def default_url(study_name: str, directory: str | Path = DEFAULT_DIR) -> str:
    return f"sqlite:///{Path(directory) / f'{study_name}.db'}"


def open_storage(spec: str | None, study_name: str, directory: str | Path = DEFAULT_DIR) -> Storage:
    """``None`` -> SQLite file ``<directory>/<study>.db``; ``sqlite:///...``, ``postgresql://...`` or any
    SQLAlchemy URL -> RDB storage; ``journal:PATH`` or a path ending in .log/.journal/.jsonl -> journal file."""
    spec = spec or default_url(study_name, directory)
    if spec.startswith("journal:") or (
        "://" not in spec and Path(spec).suffix in JOURNAL_SUFFIXES and not spec.startswith("sqlite:")
    ):
        from optuna.storages.journal import JournalFileBackend, JournalStorage  # optional: the [calibrate] extra

        path = spec.removeprefix("journal:")
        if not path:
            raise ValueError("--storage journal: needs a file path (journal:PATH)")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return Storage(JournalStorage(JournalFileBackend(path)), path, "journal", f"journal:{Path(path).resolve()}")
    if "://" not in spec:
        raise ValueError(
            f"--storage={spec!r}: expected an RDB URL (sqlite:///path.db, postgresql://user@host/db, ...) or a "
            f"journal file (journal:PATH, or a path ending in {', '.join(JOURNAL_SUFFIXES)})"
        )
    spec = _with_postgres_driver(spec)
    kwargs: dict = {}
    kind = "rdb"
    if spec.startswith("sqlite:"):
        kind = "sqlite"
        path = spec.split(":///", 1)[1] if ":///" in spec else ""
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        # Several local workers write to one file: wait for SQLite's lock instead of failing at 5 s.
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 120}}
    try:
        rdb = _create_rdb(spec, kwargs)
    except ImportError as exc:
        raise ModuleNotFoundError(f"--storage {redact(spec)}: {exc} (PostgreSQL needs psycopg[binary])") from exc
    key = f"{spec.split('://')[0]}:{redact(spec)}"
    return Storage(rdb, spec, kind, key)


def _create_rdb(spec: str, kwargs: dict, attempts: int = 5) -> optuna.storages.RDBStorage:
    """RDBStorage creates missing tables on construction; workers starting together on a new database race
    to do it and the losers fail with "already exists" / a duplicate key. Once the winner is done the tables
    exist and construction only checks them, so the losers retry."""
    import sqlalchemy.exc  # deferred: sqlalchemy (with optuna) only for database storages

    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(spec, **kwargs)
        except sqlalchemy.exc.SQLAlchemyError as exc:
            text = str(exc).lower()
            if attempt == attempts - 1 or not ("already exists" in text or "duplicate" in text):
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def _with_postgres_driver(url: str) -> str:
    """``postgresql://`` names no driver and SQLAlchemy's default changed (psycopg2 before 2.1, psycopg 3
    since): use whichever of the two is installed, so the same URL works everywhere."""
    scheme, sep, rest = url.partition("://")
    if scheme not in ("postgresql", "postgres"):
        return url

    for module, driver in (("psycopg", "psycopg"), ("psycopg2", "psycopg2")):
        if importlib.util.find_spec(module) is not None:
            return f"postgresql+{driver}{sep}{rest}"
    return f"postgresql{sep}{rest}"


# --------------------------------------------------------------------------- liveness
class Heartbeat:
    """Refreshes the ``heartbeat`` attribute of one running trial from a daemon thread."""

    def __init__(self, storage: optuna.storages.BaseStorage, trial_id: int, interval: float) -> None:
        self.storage, self.trial_id, self.interval = storage, trial_id, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"hfkv-heartbeat-{trial_id}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.storage.set_trial_user_attr(self.trial_id, HEARTBEAT, time.time())
            except Exception:  # the trial was finished (e.g. failed as stale by another worker): stop beating
                return

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def mark_started(study: optuna.Study, trial_id: int) -> None:
    study._storage.set_trial_user_attr(trial_id, WORKER, worker_id())
    study._storage.set_trial_user_attr(trial_id, HEARTBEAT, time.time())


def fail_stale(study: optuna.Study, grace_period: float, max_retry: int) -> list[int]:
    """Fail running trials whose heartbeat is older than ``grace_period``; re-queue them with the same
    parameters unless their lineage was already retried ``max_retry`` times. Returns the failed numbers."""
    now = time.time()
    failed = []
    storage = study._storage
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        beat = t.user_attrs.get(HEARTBEAT)
        if beat is None and t.datetime_start is not None:
            beat = t.datetime_start.timestamp()
        if beat is None or now - beat <= grace_period:
            continue
        try:
            storage.set_trial_user_attr(t._trial_id, "failed_reason", f"stale: no heartbeat for {now - beat:.0f}s")
            if not storage.set_trial_state_values(t._trial_id, TrialState.FAIL):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:
            continue
        failed.append(t.number)
        lineage = [*t.user_attrs.get("retry_history", []), t.number]
        if len(lineage) <= max_retry:
            # A queued trial (a base point) may die before it suggested everything: re-queue what was fixed
            # for it too, and what marks it, so its retry evaluates the same config.
            params = {**t.system_attrs.get("fixed_params", {}), **t.params}
            attrs = {k: t.user_attrs[k] for k in INHERITED if k in t.user_attrs}
            study.enqueue_trial(params, user_attrs={**attrs, "retry_of": t.number, "retry_history": lineage})
    return failed


@dataclass
class Counts:
    complete: int
    running: int
    waiting: int
    failed: int
    pruned: int = 0

    @property
    def finished(self) -> int:
        """What ``--n-trials`` counts: trials that ran to their end, complete or pruned (a pruned trial is
        finished: it is never re-run, and never selected)."""
        return self.complete + self.pruned


def counts(study: optuna.Study) -> Counts:
    states = [t.state for t in study.get_trials(deepcopy=False)]
    return Counts(
        states.count(TrialState.COMPLETE),
        states.count(TrialState.RUNNING),
        states.count(TrialState.WAITING),
        states.count(TrialState.FAIL),
        states.count(TrialState.PRUNED),
    )
