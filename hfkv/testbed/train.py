"""Train the testbed model from scratch (CPU-feasible, reproducible by seed).

    python -m hfkv.testbed.train --out hfkv/testbed/model --seed 0

A small ``LlamaForCausalLM`` (GQA, RoPE) is trained on a mixture of the testbed tasks
(``hfkv.testbed.tasks``) generated on the fly; the data of step ``s`` depends only on
(``--seed``, ``s``). The loss covers the answers only: the chain of thought and answer of
``arith_cot``, the values of the (answered and final) questions of ``kv_recall``, and the
``"\\n" </s>`` that ends each target. Contexts follow a curriculum: short at first, up to
``--max-len`` characters in the second half of training. A log (loss, periodic greedy accuracy on
held-out examples) goes to ``--log``; the model and the tokenizer are saved with
``save_pretrained`` (safetensors) in ``--out``.
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

from hfkv.testbed.tasks import TASKS
from hfkv.testbed.tokenizer import build_tokenizer, vocab

VOCAB = vocab()
PAD_ID, BOS_ID, EOS_ID = VOCAB["<pad>"], VOCAB["<s>"], VOCAB["</s>"]


def encode_chars(text: str) -> list[int]:
    unk = VOCAB["<unk>"]
    return [VOCAB.get(c, unk) for c in text]


def make_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attention_bias=False,
        mlp_bias=False,
    )


def kv_length(step: int, total: int, rng: random.Random, max_len: int) -> int:
    """Curriculum: contexts of 120-400 characters for the first 30% of training, then half of the
    kv_recall examples are longer, up to ``max_len`` from 75% of training on."""
    p = step / max(1, total)
    if p < 0.3 or rng.random() < 0.5:
        return rng.randint(120, 400)
    hi = max(400, int(400 + (max_len - 400) * min(1.0, (p - 0.3) / 0.45)))  # max_len < 400: stay at 400
    return rng.randint(max(400, hi // 2), hi)


def build_example(task: str, rng: random.Random, step: int, total: int, max_len: int) -> tuple[list, list]:
    if task == "kv_recall":
        length = kv_length(step, total, rng, max_len)
        if rng.random() < 0.6:  # dense: many records, most of them asked (more supervised tokens)
            cpr = rng.randint(16, 40)
            frac = min(rng.uniform(0.4, 1.0), 40 * cpr / length)
            ex = TASKS[task].example(rng, length=length, chars_per_record=cpr, question_frac=frac)
        else:  # like the test sets
            ex = TASKS[task].example(rng, length=length, n_questions=rng.randint(3, 10))
    else:
        ex = TASKS[task].example(rng, steps=(2, 9), consts=(2, 6), filler=(0, 10) if rng.random() < 0.8 else (0, 2))
    prompt, target = ex["prompt"], ex["target"] + "\n"
    text = prompt + target
    ids = encode_chars(text) + [EOS_ID]
    sup = [False] * len(ids)
    for a, b in ex["supervise"]:
        for i in range(a, b):
            sup[i] = True
    for i in range(len(prompt), len(ids)):
        sup[i] = True
    if rng.random() < 0.9:  # mostly with <s>, sometimes without (lm-eval may not add it)
        ids = [BOS_ID] + ids
        sup = [False] + sup
    labels = [t if s else -100 for t, s in zip(ids, sup, strict=True)]
    return ids, labels


def make_batch(seed: int, step: int, total: int, tokens: int, max_len: int):
    rng = random.Random(f"train:{seed}:{step}")
    task = "kv_recall" if step % 2 == 0 else "arith_cot"
    seqs = []
    n_tok = 0
    while n_tok < tokens:
        ids, labels = build_example(task, rng, step, total, max_len)
        seqs.append((ids, labels))
        n_tok += len(ids)
    L = max(len(s[0]) for s in seqs)
    x = torch.full((len(seqs), L), PAD_ID, dtype=torch.long)
    y = torch.full((len(seqs), L), -100, dtype=torch.long)
    for i, (ids, labels) in enumerate(seqs):
        x[i, : len(ids)] = torch.tensor(ids)
        y[i, : len(labels)] = torch.tensor(labels)
    return task, x, y


@torch.no_grad()
def greedy_accuracy(model, tok, rows, task_name: str, max_new_tokens: int) -> float:
    """Exact-match accuracy of greedy generation (plain DynamicCache), batch size 1."""
    task = TASKS[task_name]
    nl = VOCAB["\n"]
    ok = 0
    model.eval()
    for r in rows:
        enc = tok(r["prompt"], return_tensors="pt")
        out = model.generate(
            **enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[nl, EOS_ID], pad_token_id=PAD_ID
        )
        pred = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        ok += task.score(pred, r["target"])
    model.train()
    return ok / max(1, len(rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="hfkv/testbed/model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per batch (approximate)")
    p.add_argument("--max-len", type=int, default=1600, help="longest kv_recall context (characters)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=384)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-n", type=int, default=20)
    p.add_argument("--max-minutes", type=float, default=0.0, help="stop (and save) after this wall time")
    p.add_argument("--log", default=None, help="log file (default: <out>/../../../eval/testbed/train.log)")
    p.add_argument("--init", default=None, help="continue from this saved model directory")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    from transformers import LlamaForCausalLM

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
    ema = {}
    for step in range(args.steps):
        task, x, y = make_batch(args.seed, step, args.steps, args.tokens, args.max_len)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        out = model(input_ids=x, labels=y)
        out.loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lv = out.loss.item()
        ema[task] = lv if task not in ema else 0.95 * ema[task] + 0.05 * lv
        if step % 20 == 0:
            log(
                f"step {step} {task} len {x.shape[1]} bs {x.shape[0]} loss {lv:.4f} "
                f"ema kv {ema.get('kv_recall', 0):.4f} ar {ema.get('arith_cot', 0):.4f} "
                f"gn {gn:.2f} lr {lr_at(step):.2e} t {time.time() - t0:.0f}s"
            )
        last = step == args.steps - 1
        timeout = args.max_minutes and (time.time() - t0) > args.max_minutes * 60
        if (step > 0 and step % args.eval_every == 0) or last or timeout:
            accs = {
                name: greedy_accuracy(model, tok, rows, name, TASKS[name].max_new_tokens) for name, rows in held.items()
            }
            log(
                f"eval step {step}: "
                + " ".join(f"{k} {v:.3f}" for k, v in accs.items())
                + f" t {time.time() - t0:.0f}s"
            )
            save(f"step {step}")
        if timeout:
            log("time limit reached")
            break
    log(f"done in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
