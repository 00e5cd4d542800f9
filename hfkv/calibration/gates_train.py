"""``hfkv train-gates``: learned retention gates (TRIM-KV) distilled from a frozen model on this machine's CPU.

TRIM-KV trains its gates end to end: the model's attention is softened by each key's retention ``beta ** age``,
and the loss is the frozen model's own output distribution (KL) plus a capacity term that keeps the retention a
query sees under a memory ``M``. A backward pass through every layer of the model is more than two CPU cores can
give a useful number of steps, so each layer is distilled on its own here: the frozen model's forward gives every
layer's queries, keys and values once per chunk of text; a layer's gates are trained so that its attention,
softened by their retention, still gives the layer's attention output (squared error, relative to the output's own
size), while the capacity term (TRIM-KV's) asks that at every query no more than ``M`` tokens' worth of retention
stays. The model's weights do not change; no gradient goes through the model; a step costs the attention of a few
hundred sampled queries per layer.

Data: human-written text every Python installation ships (standard-library sources outside the fidelity documents
of hfkv.evaluation.human_texts and the RULER haystack of hfkv.evaluation.ruler_pydoc), or the testbed's own tasks
(their training seed, not the test sets'). The run is resumable: a checkpoint beside the output, written atomically
every ``--save-every`` steps, holds the gates, the optimiser, the step and the time spent; the same command picks
it up. The gates file records the data (with its SHA-256), the steps, the settings and the time.

    hfkv train-gates --model smollm2 --out smollm2.safetensors      # the shipped hfkv/gates/smollm2.safetensors
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import io
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfkv.cli_args import check_model, integer, validated

# Standard-library sources (code, comments and docstrings written by people): none of them a fidelity document
# (hfkv.evaluation.human_texts.SOURCES) or part of the RULER haystack (pydoc topics).
STDLIB_MODULES: tuple[str, ...] = (
    "textwrap", "collections", "pathlib", "statistics", "fractions", "difflib", "shutil", "heapq", "calendar",
    "enum", "contextlib", "string", "random", "typing", "logging", "json.decoder", "csv", "configparser", "gettext",
    "tarfile", "zipfile", "smtplib", "ftplib", "imaplib", "http.client", "urllib.request", "email.message",
    "mailbox", "pprint", "pickle", "copy", "operator", "bisect", "inspect", "pdb", "traceback", "locale", "optparse",
)  # fmt: skip
DATA = ("stdlib", "testbed")
TESTBED_SEED = 7  # the testbed tasks' examples for the gates (the test sets' seeds are 1001 and 1002)


@dataclass
class Settings:
    """What a run is: a checkpoint resumes only the same settings, but for ``steps`` (nothing depends on the total:
    the learning rate is constant, the chunks follow the step), so a run can be stopped sooner or taken further."""

    model: str
    kind: str
    data: str
    seq_len: int
    rows: int
    steps: int
    chunk_steps: int
    capacity: int
    capacity_weight: float
    hidden: int
    lr: float
    seed: int
    horizon: int = 512

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def stdlib_text() -> tuple[str, str]:
    """``(text, sha256)`` of the standard-library sources, in order."""
    text = "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in STDLIB_MODULES)
    return text, hashlib.sha256(text.encode("utf-8")).hexdigest()


def testbed_text(n: int = 400) -> tuple[str, str]:
    """``(text, sha256)``: ``n`` examples of each testbed task (prompt and answer), interleaved, drawn as the testbed
    model's own training draws them (hfkv.testbed.train.build_example): most kv_recall examples ask about many of
    their records, so what a later question reads is seen for every kind of record."""
    import random

    from hfkv.testbed.tasks import TASKS

    rng = random.Random(f"gates:{TESTBED_SEED}")
    parts = []
    for _ in range(n):
        if rng.random() < 0.7:
            recall = TASKS["kv_recall"].example(rng, length=(200, 900), tokens_per_record=rng.randint(6, 20),
                                                question_frac=rng.uniform(0.3, 1.0))  # fmt: skip
        else:
            recall = TASKS["kv_recall"].example(rng, length=(200, 900), n_questions=rng.randint(2, 8))
        arith = TASKS["arith_cot"].example(rng, steps=(1, 7), consts=(2, 6), filler=(0, 10))
        parts += ["".join(t for t, _ in ex["segments"]) for ex in (recall, arith)]
    text = "".join(parts)
    return text, hashlib.sha256(text.encode("utf-8")).hexdigest()


def chunks(tok, data: str, seq_len: int) -> tuple[list[Any], str]:
    """The data cut into ``seq_len``-token chunks ``[1, seq_len]`` (the last partial one dropped), and its hash."""
    import torch

    text, sha = stdlib_text() if data == "stdlib" else testbed_text()
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    n = ids.numel() // seq_len
    if n == 0:
        raise ValueError(f"--seq-len {seq_len}: the {data} data has only {ids.numel()} tokens")
    return [ids[i * seq_len : (i + 1) * seq_len].view(1, -1).to(torch.long) for i in range(n)], sha


def capture(model, ids):
    """Every layer's ``(query, key, value, scaling)`` over ``ids`` (a forward of the frozen model)."""
    import torch

    from hfkv.compress_once import recording

    got: dict[int, tuple] = {}

    class Recorder:
        def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
            got[module.layer_idx] = (query[0].float(), key[0].float(), value[0].float(), float(scaling))
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    with torch.no_grad(), recording(model, Recorder()):
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    return [got[i] for i in sorted(got)]


SURROGATE_GAP = 16  # the window's width in the hfkv preset: tokens nearer the query are held exact anyway


SINKS = 4  # the first tokens, which most queries attend to whatever they read: not what a query reaches back for


def chunk_stats(q, k, scaling: float, horizon: int, block: int = 512):
    """What one attention pass over a chunk gives training, from ``q [Hq, T, D]`` and ``k [H, T, D]`` (in blocks of
    queries):

    - ``targets [H, T]``, the surrogate's regression targets: the log of the most attention a key gets, relative to
      uniform (``p * (t + 1)`` for query ``t``), from the ``horizon`` queries that follow it ``SURROGATE_GAP`` or
      more positions later (0: every later query), over the query heads of its group. With a horizon every key is
      judged by as many queries, each on one scale, so neither how early a key stands nor how many keys a query
      spreads over is in the target; ``-inf`` (no target) for the first ``SINKS`` keys (a sink is a position, which
      a gate does not see) and for keys with less than a whole horizon (or the gap) after them;
    - ``reach [T]``, the attention each query gives keys that far back, past the sinks (mean over heads): the
      queries whose output a retention changes, which the distillation samples by it (most queries read only their
      neighbours and the sinks, which any retention keeps)."""
    import torch

    heads, t, _ = k.shape
    g = q.shape[0] // heads
    best = torch.zeros(heads, t)
    reach = torch.zeros(t)
    kq = k.repeat_interleave(g, 0)
    cols = torch.arange(t)
    with torch.no_grad():
        for r0 in range(0, t, block):
            rows = torch.arange(r0, min(t, r0 + block))
            logits = torch.einsum("qsd,qtd->qst", q[:, rows], kq) * scaling
            logits = logits.masked_fill(rows[:, None] < cols[None, :], float("-inf"))
            probs = torch.softmax(logits, -1)
            ahead = rows[:, None] - cols[None, :]  # [S, T] how far after each key a query stands
            far = (ahead >= SURROGATE_GAP + horizon) if horizon else torch.zeros_like(ahead, dtype=torch.bool)
            probs = probs.masked_fill((ahead < SURROGATE_GAP) | far, 0.0)
            reach[rows] = probs[..., SINKS:].sum(-1).mean(0)
            relative = probs * (rows + 1).view(1, -1, 1)
            best = torch.maximum(best, relative.view(heads, g, len(rows), t).amax(dim=(1, 2)))
    out = best.clamp_min(1e-4).log()
    out[:, :SINKS] = float("-inf")
    out[:, max(0, t - SURROGATE_GAP - horizon + (1 if horizon else 0)) :] = float("-inf")
    return out, reach


class Trainer:
    """The gates of every layer as parameters on standardised features (folded back when saved)."""

    def __init__(self, layers: int, heads: int, head_dim: int, settings: Settings) -> None:
        import torch

        from hfkv.gates import initial_gates

        self.settings = settings
        self.params = [
            {k: torch.nn.Parameter(getattr(g, k).clone()) for k in ("w1", "b1", "w2", "b2")}
            for g in initial_gates(layers, heads, head_dim, settings.hidden, settings.seed)
        ]
        self.shift: list[Any] = [None] * layers  # per layer [H, F]: the features' mean and spread on the first chunk
        self.scale: list[Any] = [None] * layers
        self.targets: dict[int, Any] = {}  # per layer, the current chunk's chunk_stats
        self.opt = torch.optim.Adam([p for layer in self.params for p in layer.values()], lr=settings.lr)

    def values(self, i: int, x):
        """``[H, T]`` what layer ``i``'s gates say (hfkv.policy.retention.gate_values) of features ``x [H, T, F]``."""
        import torch.nn.functional as F

        from hfkv.policy.retention import GateWeights, gate_logits

        p = self.params[i]
        z = (x - self.shift[i][:, None]) / self.scale[i][:, None]
        logit = gate_logits(z[None], GateWeights(p["w1"], p["b1"], p["w2"], p["b2"]))[0]
        return F.logsigmoid(logit) if self.settings.kind == "retention" else logit

    def stats(self, i: int, q, k, scaling: float):
        """Layer ``i``'s :func:`chunk_stats` on the current chunk, computed once."""
        if i not in self.targets:
            self.targets[i] = chunk_stats(q, k, scaling, self.settings.horizon)
        return self.targets[i]

    def surrogate_loss(self, i: int, x, q, k, scaling: float):
        """KVzap's regression: the gate's output against the log of the most attention any query at least
        ``SURROGATE_GAP`` tokens later gives the token (the window keeps the nearer ones), over the query heads of
        its group; tokens with no such query have no target. The targets are computed once per chunk."""

        y = self.stats(i, q, k, scaling)[0]
        pred = self.values(i, x)
        keep = y.isfinite()
        return (pred - y)[keep].square().mean()

    def layer_loss(self, i: int, q, k, v, scaling: float, rows):
        """Layer ``i``'s distillation and capacity losses on queries ``rows`` of one chunk."""
        import torch

        from hfkv.policy.retention import gate_features

        s = self.settings
        heads, t, _ = k.shape
        g = q.shape[0] // heads
        x = gate_features(k, v)
        if self.shift[i] is None:
            self.shift[i] = x.mean(1)
            self.scale[i] = x.std(1).clamp_min(1e-4)
        if s.kind == "surrogate":
            return self.surrogate_loss(i, x, q, k, scaling), torch.zeros(())
        lb = self.values(i, x)  # [H, T]
        qs = q[:, rows]  # [Hq, S, D]
        with torch.no_grad():
            logits = torch.einsum("qsd,qtd->qst", qs, k.repeat_interleave(g, 0)) * scaling
            causal = rows[:, None] >= torch.arange(t)[None, :]  # [S, T]
            logits = logits.masked_fill(~causal, float("-inf"))
            vq = v.repeat_interleave(g, 0)
            target = torch.softmax(logits, -1) @ vq  # [Hq, S, D]
        age = (rows[:, None] - torch.arange(t)[None, :]).clamp_min(0).float()  # [S, T]
        bias = age[None] * lb[:, None, :]  # [H, S, T]
        out = torch.softmax(logits + bias.repeat_interleave(g, 0), -1) @ vq
        distill = (out - target).square().sum(-1).mean() / target.square().sum(-1).mean()
        kept = (bias.exp() * causal).sum(-1)  # [H, S]: tokens' worth of retention each query sees
        over = torch.relu(kept - s.capacity).mean() / s.capacity
        return distill, over

    def step(self, captured, generator) -> dict[str, float]:
        import torch

        s = self.settings
        self.opt.zero_grad()
        total_d = total_o = 0.0
        for i, (q, k, v, scaling) in enumerate(captured):
            rows = None
            if s.kind == "retention":  # the queries a retention changes (chunk_stats), none before the capacity
                reach = self.stats(i, q, k, scaling)[1].clone()
                reach[: min(s.capacity, reach.numel() - 1)] = 0
                rows = torch.multinomial(reach + 1e-6, s.rows, replacement=True, generator=generator)
            distill, over = self.layer_loss(i, q, k, v, scaling, rows)
            (distill + s.capacity_weight * over).backward()
            total_d, total_o = total_d + distill.item(), total_o + over.item()
        self.opt.step()
        n = len(captured)
        return {"loss": total_d / n, "over_capacity": total_o / n}  # distillation (retention) or regression error

    def gate_weights(self):
        """The trained gates on raw features: the standardisation folded into the first layer."""
        import torch

        from hfkv.policy.retention import GateWeights

        out = []
        for p, shift, scale in zip(self.params, self.shift, self.scale, strict=True):
            with torch.no_grad():
                w1 = p["w1"] / scale[:, :, None]
                b1 = p["b1"] - torch.einsum("hf,hfm->hm", shift, w1)
                out.append(GateWeights(w1.clone(), b1.clone(), p["w2"].detach().clone(), p["b2"].detach().clone()))
        return out

    def state(self) -> dict[str, Any]:
        return {
            "params": [{k: v.detach() for k, v in layer.items()} for layer in self.params],
            "shift": self.shift,
            "scale": self.scale,
            "opt": self.opt.state_dict(),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        import torch

        with torch.no_grad():
            for layer, saved in zip(self.params, state["params"], strict=True):
                for k, v in saved.items():
                    layer[k].copy_(v)
        self.shift, self.scale = state["shift"], state["scale"]
        self.opt.load_state_dict(state["opt"])


def checkpoint_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def train(model, tok, settings: Settings, out: Path, save_every: int = 50, log=print) -> Path:
    """Train (or resume) the gates of ``model`` and write them to ``out``; returns ``out``."""
    import torch

    from hfkv.atomic import write_atomic
    from hfkv.gates import Gates
    from hfkv.model_shape import ModelShape

    shape = ModelShape.of(model)
    data, sha = chunks(tok, settings.data, settings.seq_len)
    trainer = Trainer(shape.layers, shape.kv_heads, shape.head_dim, settings)
    ckpt = checkpoint_path(out)
    step, spent, history = 0, 0.0, []
    generator = torch.Generator().manual_seed(settings.seed)
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        if {**state["settings"], "steps": settings.steps} != settings.as_dict():
            raise ValueError(
                f"{ckpt}: a checkpoint of other settings ({state['settings']}); delete it or run with those settings"
            )
        if state["step"] > settings.steps:
            raise ValueError(f"{ckpt}: already at step {state['step']}, past --steps {settings.steps}")
        trainer.load_state(state["trainer"])
        step, spent, history = state["step"], state["seconds"], state["history"]
        generator.set_state(state["generator"])
        log(f"resuming at step {step} of {settings.steps} ({spent:.0f} s spent)")

    def save_checkpoint() -> None:
        buf = io.BytesIO()
        torch.save({"settings": settings.as_dict(), "trainer": trainer.state(), "step": step, "seconds": spent,
                    "history": history, "generator": generator.get_state()}, buf)  # fmt: skip
        write_atomic(ckpt, buf.getvalue())

    captured, chunk_at = None, -1
    while step < settings.steps:
        start = time.perf_counter()
        c = (step // settings.chunk_steps) % len(data)
        if c != chunk_at:
            captured, chunk_at = capture(model, data[c]), c
            trainer.targets = {}
        losses = trainer.step(captured, generator)
        step += 1
        spent += time.perf_counter() - start
        history.append({"step": step, "chunk": c, **{k: round(v, 5) for k, v in losses.items()}})
        if step % save_every == 0 or step == settings.steps:
            save_checkpoint()
            log(f"step {step}/{settings.steps}  loss {losses['loss']:.4f}  over {losses['over_capacity']:.4f}"
                f"  {spent:.0f} s")  # fmt: skip
    training = {
        "command": "hfkv train-gates",
        "settings": settings.as_dict(),
        "data": {
            "source": settings.data,
            "sha256": sha,
            "chunks": len(data),
            "chunks_used": min(len(data), math.ceil(settings.steps / settings.chunk_steps)),
        },  # fmt: skip
        "seconds": round(spent, 1),
        "threads": torch.get_num_threads(),
        "last": history[-10:],
    }
    model_meta = {"name": settings.model, "layers": shape.layers, "kv_heads": shape.kv_heads,
                  "head_dim": shape.head_dim}  # fmt: skip
    path = Gates(trainer.gate_weights(), model_meta, training, settings.kind).save(out)
    ckpt.unlink(missing_ok=True)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", type=validated(lambda s: check_model("--model", s), "model"),
                        help="model spec (hfkv.loading): smollm2, testbed, a hub id or a directory")  # fmt: skip
    parser.add_argument("--kind", default="retention", choices=("retention", "surrogate"),
                        help="retention: TRIM-KV's decaying retention (distilled with a capacity term); surrogate: "
                             "KVzap's static importance (regressed on the attention later queries give)")  # fmt: skip
    parser.add_argument("--data", default=None, choices=DATA,
                        help="training text: stdlib (human-written; the default) or testbed (its tasks; the default "
                             "for --model testbed)")  # fmt: skip
    parser.add_argument("--out", required=True, help="the gates file to write (.safetensors); its checkpoint beside")
    parser.add_argument("--seq-len", type=integer(64), default=2048, help="tokens per chunk of text")
    parser.add_argument("--rows", type=integer(1), default=256, help="queries sampled per chunk and step")
    parser.add_argument("--steps", type=integer(1), default=400, help="optimiser steps (a resumed run may change it)")
    parser.add_argument("--chunk-steps", type=integer(1), default=4, help="steps on each chunk before the next")
    parser.add_argument(
        "--capacity",
        type=integer(1),
        default=128,
        help="TRIM-KV's M: tokens' worth of retention a query may see before the capacity term",
    )
    parser.add_argument("--capacity-weight", type=float, default=1.0, help="weight of the capacity term (retention)")
    parser.add_argument("--hidden", type=integer(1), default=32, help="hidden width of each head's gate")
    parser.add_argument("--horizon", type=integer(0), default=512,
                        help="the queries after a token that judge it (the surrogate's targets, the distillation's "
                             "sampled queries); 0: every later one")  # fmt: skip
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam's learning rate")
    parser.add_argument("--seed", type=integer(0), default=0, help="the gates' initialisation and the query sampling")
    parser.add_argument("--save-every", type=integer(1), default=50, help="steps between checkpoints (and log lines)")
    parser.add_argument("--threads", type=integer(1), default=None, help="torch threads (default: torch's)")


def run(args: argparse.Namespace) -> int:
    import torch

    from hfkv.loading import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    if out.suffix != ".safetensors":
        raise ValueError(f"--out {args.out!r}: a gates file ends in .safetensors")
    data = args.data or ("testbed" if args.model == "testbed" else "stdlib")
    settings = Settings(args.model, args.kind, data, args.seq_len, args.rows, args.steps, args.chunk_steps,
                        args.capacity, args.capacity_weight, args.hidden, args.lr, args.seed, args.horizon)  # fmt: skip
    model, tok = load_model(args.model, dtype="float32")
    model.requires_grad_(False)
    path = train(model, tok, settings, out, args.save_every)
    print(f"wrote {path}")
    return 0
