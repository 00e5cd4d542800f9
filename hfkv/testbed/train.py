"""Train the testbed model from scratch (CPU-feasible, reproducible by seed).

    python -m hfkv.testbed.train --out hfkv/testbed/model --seed 0

A small ``LlamaForCausalLM`` (GQA, RoPE) is trained on a mixture of the testbed tasks
(``hfkv.testbed.tasks``) generated on the fly, plus a copy task early on; the data of step ``s``
depends only on (``--seed``, ``s``). The loss covers what is predictable only: the chain of
thought and answer of ``arith_cot``, the values of the (answered and final) questions of
``kv_recall``, the second half of a copy example, and the ``"\\n" </s>`` that ends each target.
kv_recall contexts follow a curriculum: short at first, up to ``--max-len`` tokens later. The
random init contains an induction circuit (``init_induction_circuit``), which spares the loss
plateau that kept the first attempt at 0% (``eval/testbed/NOTES.md``). A log (loss and token
accuracy per task, periodic greedy accuracy on held-out examples) goes to ``--log``; the model
and the tokenizer are saved with ``save_pretrained`` (safetensors) in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hfkv.testbed.protocol import evaluate
from hfkv.testbed.tasks import TASKS
from hfkv.testbed.tokenizer import KEY_WORDS, build_tokenizer, pretokenize, vocab

VOCAB = vocab()
PAD_ID, BOS_ID, EOS_ID, UNK_ID = VOCAB["<pad>"], VOCAB["<s>"], VOCAB["</s>"], VOCAB["<unk>"]


def encode(text: str) -> list[int]:
    """Token ids of ``text`` (no ``<s>``), identical to the shipped tokenizer's, without its overhead."""
    return [VOCAB.get(p, UNK_ID) for p in pretokenize(text)]


def make_config(args):
    return LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=4096,
        rope_theta=args.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attention_bias=False,
        mlp_bias=False,
    )


def _orthonormal(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """(rows, cols) with orthonormal columns and row 0 zero (the constant channel is left alone)."""
    q = torch.linalg.qr(torch.randn(rows, cols, generator=gen, dtype=torch.float64))[0]
    q[0] = 0.0
    return q


@torch.no_grad()
def init_induction_circuit(
    model,
    prev_pairs: int = 8,
    prev_sharpness: float = 10.0,
    match_pairs: int = 8,
    match_sharpness: float = 16.0,
    copy_gain: float = 4.0,
    seed: int = 0,
) -> None:
    """Build an induction circuit into the random init: query head 0 of layer 0 attends to the
    previous token, query head 0 of layer 1 to the token after an earlier copy of the current one.

    Recall needs exactly this circuit, and neither half gets a gradient before the other exists,
    so tiny models sit on a long loss plateau (the first attempt never left it; a second one with
    only the first half built in left it too slowly for 2 CPU cores). Everything stays trainable.

    Layer 0: a constant channel (embedding dimension 0, pinned by ``project_embeddings``) gives a
    content-free query and key whose RoPE phases peak at a distance of exactly one token
    (``prev_sharpness``: logit margin over every other distance up to 4096); the value/output maps
    write a random ``head_dim``-dimensional code of the previous token into the residual.
    Layer 1: query (the current token's code) and key (the previous-token code in the residual)
    use only the ``match_pairs`` lowest RoPE frequencies, which hardly rotate over the context, so
    the match is by content (``match_sharpness``: mean logit margin of the true match); the
    value/output maps copy the attended token's embedding (projected on ``head_dim`` dimensions,
    times ``copy_gain``) towards the tied LM head.
    """
    cfg = model.config
    if cfg.num_hidden_layers < 2:
        raise ValueError(f"init_induction_circuit: num_hidden_layers={cfg.num_hidden_layers}; the circuit needs >= 2")
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if 2 * match_pairs > hd or prev_pairs > hd // 2:
        raise ValueError(
            f"init_induction_circuit: head_dim={hd} has {hd // 2} RoPE pairs; "
            f"prev_pairs={prev_pairs} and match_pairs={match_pairs} must each fit"
        )
    base = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    theta = base ** (-torch.arange(hd // 2, dtype=torch.float64) * 2 / hd)
    gen = torch.Generator().manual_seed(seed)
    emb = model.model.embed_tokens.weight
    dt = emb.dtype
    l0, l1 = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    project_embeddings(model)

    # --- layer 0: previous-token head
    h0 = model.model.layers[0].input_layernorm(emb)[:, 0].double().mean().item()
    d = torch.arange(4096, dtype=torch.float64)
    S = torch.cos((d[:, None] - 1) * theta[None, :prev_pairs]).sum(1)
    margin = (S[1] - torch.cat([S[:1], S[2:]]).max()).item()
    a = math.sqrt(prev_sharpness * math.sqrt(hd) / margin) / h0
    l0.q_proj.weight[:hd] = 0.0
    l0.k_proj.weight[:hd] = 0.0
    for i in range(prev_pairs):
        l0.q_proj.weight[i, 0] = a * math.cos(theta[i])
        l0.q_proj.weight[i + hd // 2, 0] = -a * math.sin(theta[i])
        l0.k_proj.weight[i, 0] = a
    v0 = _orthonormal(cfg.hidden_size, hd, gen)
    o0 = _orthonormal(cfg.hidden_size, hd, gen)
    l0.v_proj.weight[:hd] = v0.T.to(dt)
    l0.o_proj.weight[:, :hd] = (EMBED_RADIUS / 6 * o0).to(dt)

    # --- layer 1: induction head (content match on the lowest frequencies, copy the attended token)
    pairs = list(range(hd // 2 - match_pairs, hd // 2))
    dims = pairs + [i + hd // 2 for i in pairs]
    w = _orthonormal(hd + 1, len(dims), gen)[1:].T  # (2*match_pairs, hd), orthonormal rows
    l1.q_proj.weight[:hd] = 0.0
    l1.k_proj.weight[:hd] = 0.0
    l1.q_proj.weight[dims] = (w @ v0.T).to(dt)  # the current token's code
    l1.k_proj.weight[dims] = (w @ o0.T).to(dt)  # the previous token's code, as layer 0 wrote it
    # calibrate: mean score of the true match minus the mean score of other positions
    ids = torch.randint(4, emb.shape[0], (1, 512), generator=gen)
    hs = model.model(input_ids=ids, output_hidden_states=True).hidden_states[1]
    y = model.model.layers[1].input_layernorm(hs)[0]
    q = y @ l1.q_proj.weight[:hd].T
    k = y @ l1.k_proj.weight[:hd].T
    scores = q[:-1] @ k.T / math.sqrt(hd)  # query t against key s; the true match of t is s = t + 1
    true = scores.diagonal(1).mean()
    gap = (true - scores.mean()).item()
    beta = math.sqrt(match_sharpness / gap)
    l1.q_proj.weight[:hd] *= beta
    l1.k_proj.weight[:hd] *= beta
    v1 = _orthonormal(cfg.hidden_size, hd, gen)
    l1.v_proj.weight[:hd] = v1.T.to(dt)
    l1.o_proj.weight[:, :hd] = (copy_gain * v1).to(dt)


EMBED_RADIUS = 1.0  # norm of every token embedding without its constant channel
CONSTANT_CHANNEL = 0.8


@torch.no_grad()
def project_embeddings(model) -> None:
    """Pin the constant channel and give every token embedding the same norm (after each step).

    The previous-token head of ``init_induction_circuit`` scores positions through dimension 0
    after RMSNorm, which is only constant if every embedding has the same norm; left free, the
    channel drifts within a few hundred steps and the head dissolves before the induction head
    that needs it has formed. Tied to the LM head, the channel adds one logit to every token.
    """
    emb = model.model.embed_tokens.weight
    rest = emb[:, 1:]
    emb[:, 1:] = rest / rest.norm(dim=1, keepdim=True).clamp(min=1e-8) * EMBED_RADIUS
    emb[:, 0] = CONSTANT_CHANNEL


def kv_length(step: int, total: int, rng: random.Random, max_len: int) -> int:
    """Curriculum: kv_recall contexts of 48-256 tokens for the first 20% of training, then up to
    ``max_len`` tokens by 60% of training (half of the examples stay short throughout)."""
    p = step / max(1, total)
    if p < 0.2 or rng.random() < 0.4:
        return rng.randint(48, 256)
    hi = int(256 + (max_len - 256) * min(1.0, (p - 0.2) / 0.4))
    return rng.randint(128, max(256, hi))


def copy_example(rng: random.Random) -> dict:
    """A random run of keys and numbers, then the same run again (supervised): the cheapest data
    on which content-based induction heads form, which kv_recall and arith_cot both need."""
    n = rng.randint(4, 40)
    words = [rng.choice(KEY_WORDS) if rng.random() < 0.5 else str(rng.randint(10, 99)) for _ in range(n)]
    text = " ".join(words)
    return {"segments": [(f"- {text}\n?", False), (f" {text}\n", True)]}


def build_example(
    task: str,
    rng: random.Random,
    step: int,
    total: int,
    max_len: int,
    arith_recall: bool = True,
    literal_frac: float = 0.0,
) -> tuple[list, list]:
    """(ids, labels) of one training example; labels are -100 where the text is unpredictable."""
    if task == "copy":
        ex = copy_example(rng)
    elif task == "kv_recall":
        length = kv_length(step, total, rng, max_len)
        if rng.random() < 0.7:  # dense: most records asked (many supervised lookups per sequence)
            ex = TASKS[task].example(
                rng, length=length, tokens_per_record=rng.randint(6, 20), question_frac=rng.uniform(0.3, 1.0)
            )
        else:  # like the test sets
            ex = TASKS[task].example(rng, length=length, n_questions=rng.randint(2, 8))
    else:
        filler = (0, 10) if rng.random() < 0.7 else (0, 2)
        consts = 0 if literal_frac and rng.random() < literal_frac else (2, 6)
        ex = TASKS[task].example(rng, steps=(1, 7), consts=consts, filler=filler, recall=arith_recall)
    ids: list[int] = []
    labels: list[int] = []
    for text, supervised in ex["segments"]:
        t = encode(text)
        ids += t
        labels += t if supervised else [-100] * len(t)
    ids.append(EOS_ID)
    labels.append(EOS_ID)
    if rng.random() < 0.9:  # mostly with <s>, sometimes without (lm-eval may not add it)
        ids = [BOS_ID] + ids
        labels = [-100] + labels
    return ids, labels


def make_batch(
    seed: int,
    step: int,
    total: int,
    tokens: int,
    max_len: int,
    copy_frac: float = 0.0,
    arith_frac: float = 0.5,
    arith_recall: bool = True,
    literal_frac: float = 0.0,
):
    """The batch of ``step``: about ``tokens`` tokens, ``copy_frac`` of the examples copy, then
    ``arith_frac`` of the rest arith_cot, the others kv_recall; depends only on the arguments."""
    rng = random.Random(f"train:{seed}:{step}")
    seqs = []
    n_tok = 0
    while n_tok < tokens:
        u = rng.random()
        # = 1 - (1 - copy_frac) * arith_frac, written so that arith_frac 0.5 is bit-exact (1 + copy_frac) / 2
        kv_cut = (1 + copy_frac - (2 * arith_frac - 1) * (1 - copy_frac)) / 2
        task = "copy" if u < copy_frac else "kv_recall" if u < kv_cut else "arith_cot"
        ids, labels = build_example(task, rng, step, total, max_len, arith_recall, literal_frac)
        seqs.append((task, ids, labels))
        n_tok += len(ids)
    seqs.sort(key=lambda s: len(s[1]))
    L = max(len(s[1]) for s in seqs)
    x = torch.full((len(seqs), L), PAD_ID, dtype=torch.long)
    y = torch.full((len(seqs), L), -100, dtype=torch.long)
    kind = torch.tensor([("kv_recall", "arith_cot", "copy").index(s[0]) for s in seqs])
    for i, (_, ids, labels) in enumerate(seqs):
        x[i, : len(ids)] = torch.tensor(ids)
        y[i, : len(labels)] = torch.tensor(labels)
    return x, y, kind


def batch_losses(model, x, y, kind) -> tuple[torch.Tensor, dict]:
    """Mean loss over supervised tokens, plus per-task loss and token accuracy (for the log)."""
    logits = model(input_ids=x).logits[:, :-1].float()
    tgt = y[:, 1:]
    mask = tgt != -100
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tgt.clamp(min=0), reduction="none")
    loss = (nll * mask).sum() / mask.sum().clamp(min=1)
    with torch.no_grad():
        correct = (logits.argmax(-1) == tgt) & mask
        stats = {}
        for i, name in enumerate(("kv", "ar", "copy")):
            rows = kind == i
            if not rows.any():
                continue
            m = mask[rows]
            n = m.sum().clamp(min=1)
            stats[name] = ((nll[rows] * m).sum() / n).item(), (correct[rows].sum() / n).item()
    return loss, stats


def greedy_accuracy(model, tok, rows, task_name: str) -> float:
    """Exact-match accuracy of greedy generation with a plain DynamicCache, one prompt at a time
    (the demo's evaluation, so the log and ``hfkv demo`` measure the same thing)."""
    model.eval()
    acc = evaluate(model, tok, task_name, rows, batch_size=1)["accuracy"]
    model.train()
    return acc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="hfkv/testbed/model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=2400)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per batch (approximate)")
    p.add_argument("--max-len", type=int, default=720, help="longest kv_recall context (tokens)")
    p.add_argument(
        "--no-prev-token-init",  # the name predates the induction head; the log's args say prev_token_init
        dest="prev_token_init",
        action="store_false",
        help="start from a plain random init (see init_induction_circuit)",
    )
    p.add_argument("--rope-theta", type=float, default=1e7, help="RoPE base (large: content matching is position-free)")
    p.add_argument("--copy-frac", type=float, default=0.3, help="share of copy examples at the start")
    p.add_argument("--copy-steps", type=int, default=1500, help="the copy share falls to 0 by this step")
    p.add_argument("--arith-frac", type=float, default=0.5, help="share of arith_cot among the task examples")
    p.add_argument(
        "--no-arith-recall",
        dest="arith_recall",
        action="store_false",
        help="arith_cot chains of thought without recalled constants (stages 1-2 of the shipped model)",
    )
    p.add_argument(
        "--literal-frac", type=float, default=0.0, help="share of arith_cot examples without named constants"
    )
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-n", type=int, default=10)
    p.add_argument(
        "--stop-at", type=int, default=-1, help="stop (and save) after this step; the schedule stays --steps"
    )
    p.add_argument("--max-minutes", type=float, default=0.0, help="stop (and save) after this wall time")
    p.add_argument("--log", default=None, help="log file (default: <out>/../../../eval/testbed/train.log)")
    p.add_argument("--init", default=None, help="continue from this saved model directory")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    os.makedirs(args.out, exist_ok=True)
    log_path = args.log or os.path.join("eval", "testbed", "train.log")
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    logf = open(log_path, "a", encoding="utf-8")

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    if args.init:
        model = LlamaForCausalLM.from_pretrained(args.init, attn_implementation="sdpa")
    else:
        model = LlamaForCausalLM._from_config(make_config(args), attn_implementation="sdpa")
        if args.prev_token_init:
            init_induction_circuit(model)
    model.float()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"start: {' '.join(sys.argv)}")
    log(f"args: {json.dumps(vars(args))}")
    log(f"params: {n_params}  torch {torch.__version__}  threads {torch.get_num_threads()}")

    tok = build_tokenizer()
    held = {
        name: TASKS[name].generate(args.eval_n, seed=10_000 + args.seed, **TASKS[name].test_kwargs) for name in TASKS
    }

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        q = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, q))))

    def save(tag: str) -> None:
        model.generation_config.eos_token_id = [VOCAB["\n"], EOS_ID]
        model.generation_config.pad_token_id = PAD_ID
        model.generation_config.bos_token_id = BOS_ID
        model.save_pretrained(args.out, safe_serialization=True)
        tok.save_pretrained(args.out)
        log(f"saved ({tag}) to {args.out}")

    t0 = time.time()
    model.train()
    ema: dict[str, list[float]] = {}
    for step in range(args.steps):
        copy_frac = args.copy_frac * max(0.0, 1 - step / max(1, args.copy_steps))
        x, y, kind = make_batch(
            args.seed,
            step,
            args.steps,
            args.tokens,
            args.max_len,
            copy_frac,
            args.arith_frac,
            args.arith_recall,
            args.literal_frac,
        )
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss, stats = batch_losses(model, x, y, kind)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.prev_token_init:
            project_embeddings(model)
        for k, v in stats.items():
            ema[k] = list(v) if k not in ema else [0.9 * e + 0.1 * n for e, n in zip(ema[k], v, strict=True)]
        if step % 20 == 0:
            log(
                f"step {step} len {x.shape[1]} bs {x.shape[0]} loss {loss.item():.4f} "
                + " ".join(f"{k} {v[0]:.3f}/{v[1]:.3f}" for k, v in ema.items())
                + f" gn {gn:.2f} lr {lr_at(step):.2e} t {time.time() - t0:.0f}s"
            )
        last = step == args.steps - 1 or step == args.stop_at
        timeout = args.max_minutes and (time.time() - t0) > args.max_minutes * 60
        if (step > 0 and step % args.eval_every == 0) or last or timeout:
            accs = {name: greedy_accuracy(model, tok, rows, name) for name, rows in held.items()}
            log(
                f"eval step {step}: "
                + " ".join(f"{k} {v:.3f}" for k, v in accs.items())
                + f" t {time.time() - t0:.0f}s"
            )
            save(f"step {step}")
        if timeout:
            log("time limit reached")
            break
        if step == args.stop_at:
            log(f"stopped at step {step} (--stop-at)")
            break
    log(f"done in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
