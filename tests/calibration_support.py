"""Helpers of the calibration tests: a tiny random model with a byte-level tokenizer saved to disk (so
worker processes load it by path, like a real model), the fixture, a throw-away PostgreSQL server, and a
fake objective (no model) for properties that need many studies."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.models import tiny_model

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "calibration" / "data" / "math_fixture.jsonl"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_tokenizer(chat: bool = False):
    """One token per UTF-8 byte (256) + eos + pad: encodes any text, needs no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|eos|>", pad_token="<|pad|>")
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def save_tiny(path: Path, chat: bool = False, seed: int = 0) -> Path:
    """A 2-layer random Llama (4 query / 2 KV heads, head_dim 32) and its tokenizer in ``path``."""
    tok = byte_tokenizer(chat)
    model = tiny_model("llama", seed=seed, vocab_size=len(tok), max_position_embeddings=4096)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    cands = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return cands[-1] if cands else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def postgres_server():
    """Yield a URL of a fresh local PostgreSQL cluster (initdb + pg_ctl), or raise RuntimeError saying why not.

    Runs as the current user; as root, as the ``postgres`` system user (the server refuses root).
    """
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not initdb or not pg_ctl:
        raise RuntimeError("no PostgreSQL server binaries (initdb, pg_ctl) on PATH or in /usr/lib/postgresql/*/bin")
    prefix: list[str] = []
    if os.geteuid() == 0:
        runuser = shutil.which("runuser")
        if not runuser:
            raise RuntimeError("running as root without runuser: cannot start PostgreSQL as an unprivileged user")
        prefix = [runuser, "-u", "postgres", "--"]
    root = Path(tempfile.mkdtemp(prefix="hfkv-pg-"))
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    if prefix:
        shutil.chown(root, "postgres")
        shutil.chown(sock, "postgres")
    port = _free_port()
    try:
        subprocess.run([*prefix, initdb, "-D", str(data), "-U", "postgres", "-A", "trust"], check=True,
                       capture_output=True, timeout=120)  # fmt: skip
        subprocess.run(
            [*prefix, pg_ctl, "-D", str(data), "-l", str(root / "log"), "-w", "-t", "60", "-o",
             f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off", "start"],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, PermissionError, LookupError) as exc:
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"could not start PostgreSQL: {exc}") from exc
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*prefix, pg_ctl, "-D", str(data), "-m", "immediate", "stop"], capture_output=True, timeout=60)
        time.sleep(0.2)
        shutil.rmtree(root, ignore_errors=True)


def cli_args(model_dir, tmp, *extra) -> list[str]:
    """``hfkv calibrate`` arguments of a small study on the fixture that writes only under ``tmp``."""
    return [
        "calibrate",
        "--model", str(model_dir),
        "--data-file", str(FIXTURE),
        "--n-problems", "3",
        "--max-solution-tokens", "24",
        "--pruner", "none",  # these tests count complete trials; pruning has its own (tests/test_calibration_prune.py)
        "--studies-dir", str(Path(tmp) / "studies"),
        "--config-dir", str(Path(tmp) / "configs"),
        "--no-progress",
        *map(str, extra),
    ]  # fmt: skip


def _config_key(cfg, *drop: str) -> str:
    d = {k: v for k, v in cfg.to_dict().items() if k not in ("name", "provenance", *drop)}
    return json.dumps(d, sort_keys=True, default=str)


class FakeObjective:
    """A stand-in for a model in the calibration loop: KL, top-1 and memory are cheap deterministic functions
    of the config alone (a seeded hash of its fields), so a test can draw any landscape, including ones
    where the base is the best point and ones where it is the worst (``base_factor`` scales its KL).

    Memory grows with the budget and depends on the thresholds (and may exceed the full cache, as small
    sequences make real configs do); KL falls with the budget, times a per-threshold factor and a little
    per-config jitter. ``evaluated`` maps each config's name (``trial<N>`` in a study) to the config.
    """

    name = "fidelity"
    metrics = ("kl", "top1")

    def __init__(self, seed: int, base=None, base_factor: float = 1.0, length: int = 200, n_problems: int = 3) -> None:
        self.seed, self.base, self.base_factor, self.length = seed, base, base_factor, length
        self.n_problems = n_problems
        self.evaluated: dict = {}
        self.steps: dict = {}  # config name -> problems evaluated (fewer than n_problems: stopped by a pruner)

    def _u(self, *parts: str) -> float:
        digest = hashlib.sha256(json.dumps([self.seed, *parts]).encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64

    def longest(self) -> int:
        return self.length

    def evaluate(self, cfg, progress: bool = False, on_problem=None):
        """``on_problem(i, running)`` after each of ``n_problems`` problems, as the real objectives do; the
        running values are the final ones (every problem scores alike), so a pruner sees the trial's worth."""
        self.evaluated[cfg.name] = cfg
        ev = self._evaluate(cfg)
        self.steps[cfg.name] = 0
        for i in range(self.n_problems):
            self.steps[cfg.name] = i + 1
            if on_problem is not None:
                on_problem(i, ev)
        return ev

    def _evaluate(self, cfg):
        from hfkv.calibration.objectives import Evaluation

        dense = 1_000_000
        if not cfg.compress:
            return Evaluation({"kl": 0.0, "top1": 1.0}, dense, dense, 1)
        shape, whole = _config_key(cfg, "budget"), _config_key(cfg)
        share = min(1.0, (cfg.budget or self.length) / self.length)
        memory = share * (0.55 + 0.6 * self._u("memory", shape))
        kl = (0.002 + 0.05 * (1.0 - share) ** 2) * (0.3 + 1.4 * self._u("kl", shape))
        kl *= 1.0 + 0.3 * self._u("jitter", whole)
        if self.base is not None and shape == _config_key(self.base, "budget"):
            kl *= self.base_factor
        return Evaluation({"kl": kl, "top1": max(0.0, 1.0 - 4.0 * kl)}, round(memory * dense), dense, 1)
