"""Long documents for real-model fidelity, written by the model itself from short topic prompts.

Fidelity needs long text the model finds natural, with no dataset download and no licence question:
the model generates it (chat template, sampling with a fixed seed, EOS and special tokens suppressed
until the length is reached, a mild repetition penalty) from the topic prompts below, which ask for
texts full of names, numbers and facts that a later passage refers back to — what a KV cache can lose.
The documents are cached in a committed JSONL file (token ids, text, generation settings), so every
sweep scores exactly the same tokens:

    python -m hfkv.evaluation.texts --model smollm2 --docs 4     # -> eval/results/texts/smollm2.jsonl

Protocol (the issue's): each document is ``prompt_len`` (1,536) tokens of prompt — the chat-formatted
topic request followed by the start of the generated text — and a ``continuation`` (384 tokens) that
fidelity is scored on.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

from hfkv.atomic import write_atomic
from hfkv.evaluation.results import dumps_row, read_rows

TOPICS: tuple[str, ...] = (
    "Write a long, detailed history of a fictional river town from its founding to today. Name its founding "
    "families, its streets and bridges, and give the year of every important event.",
    "Write a long travel diary of a two-week train journey across Europe. For every day give the date, the "
    "stations, the people met by name and what was eaten, and refer back to earlier days.",
    "Write a long detective story about a theft at a small museum. Keep track of each suspect by name, their "
    "alibi and every clue, and explain at the end how the clues fit together.",
    "Write the detailed minutes of a long town council meeting about building a new bridge: who spoke, the "
    "figures of the budget, each objection and amendment, and the final vote of every member.",
    "Explain step by step how a compiler turns source code into machine code, using a small made-up language "
    "with named variables and functions as a running example.",
    "Write a detailed guide to the planets of the solar system, one by one, with their sizes, distances, moons "
    "and the missions that explored them, comparing each planet with the ones before.",
    "Describe month by month how to plan, plant and keep a vegetable garden for a whole year, naming the beds, "
    "the varieties sown in each and the dates of sowing and harvest.",
    "Explain the causes, main events and consequences of the industrial revolution, with dates, inventors, "
    "inventions and places, and how each development led to the next.",
)
PROMPT_TOKENS = 1536
CONTINUATION_TOKENS = 384
SETTINGS = {"temperature": 0.8, "top_p": 0.95, "repetition_penalty": 1.1, "seed": 1234}
DEFAULT_DIR = Path("eval/results/texts")  # the committed texts the sweeps read
USER_DIR = Path("hfkv-out/eval/texts")  # where `python -m hfkv.evaluation.texts` writes unless --out names a file


def model_tag(spec: str) -> str:
    """File-name tag of a model spec: ``smollm2``, ``org--name`` for hub ids, the folder name for paths."""
    spec = spec.rstrip("/")
    if os.path.isdir(spec):
        return Path(spec).name
    return spec.replace("/", "--")


def default_path(spec: str) -> Path:
    return DEFAULT_DIR / f"{model_tag(spec)}.jsonl"


def _chat_ids(tok, topic: str) -> list[int]:
    messages = [{"role": "user", "content": topic}]
    if getattr(tok, "chat_template", None):
        out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(i) for i in ids]
    return [int(i) for i in tok(topic + "\n\n")["input_ids"]]


def generate_documents(
    model,
    tok,
    n_docs: int,
    prompt_tokens: int = PROMPT_TOKENS,
    continuation_tokens: int = CONTINUATION_TOKENS,
    settings: dict[str, Any] | None = None,
    first: int = 0,
) -> list[dict[str, Any]]:
    """Documents ``first .. first + n_docs - 1`` (topic ``i % len(TOPICS)``), generated in one sampled batch.

    Each has exactly ``prompt_tokens + continuation_tokens`` token ids: the chat-formatted request, then
    generated text. Sampling draws for the whole batch, so a document depends on the batch it was made
    in (recorded in ``settings.batch``); the committed file, not the seed, is what makes sweeps repeatable.
    """
    s = {**SETTINGS, **(settings or {})}
    total = prompt_tokens + continuation_tokens
    idx = list(range(first, first + n_docs))
    prompts = [_chat_ids(tok, TOPICS[i % len(TOPICS)]) for i in idx]
    if max(len(p) for p in prompts) >= prompt_tokens:
        raise ValueError(
            f"prompt_tokens={prompt_tokens} must exceed the chat-formatted topic requests "
            f"({max(len(p) for p in prompts)} tokens with this tokenizer)"
        )
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    new = total - min(len(p) for p in prompts)
    special = sorted({int(i) for i in tok.all_special_ids})
    torch.manual_seed(int(s["seed"]))
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            do_sample=True,
            temperature=s["temperature"],
            top_p=s["top_p"],
            repetition_penalty=s["repetition_penalty"],
            max_new_tokens=new,
            min_new_tokens=new,
            suppress_tokens=special,  # EOS / chat markers never appear, so the text runs to the length
            pad_token_id=pad,
        )
    docs = []
    for row, (i, p) in enumerate(zip(idx, prompts, strict=True)):
        gen = out[row, width:].tolist()
        doc_ids = p + gen[: total - len(p)]
        docs.append(
            {
                "id": i,
                "topic": TOPICS[i % len(TOPICS)],
                "ids": doc_ids,
                "prompt_len": prompt_tokens,
                "n_tokens": len(doc_ids),
                "chat_prefix_len": len(p),
                "text": tok.decode(doc_ids[len(p) :]),
                "settings": {**s, "batch": idx, "dtype": str(model.dtype).removeprefix("torch.")},
            }
        )
    return docs


def load_documents(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Documents of a texts file, checked for the fields fidelity needs."""
    docs = read_rows(path)
    for d in docs:
        for key in ("id", "ids", "prompt_len"):
            if key not in d:
                raise ValueError(f"{path}: document {d.get('id', '?')} has no {key!r}")
        if not 0 < d["prompt_len"] < len(d["ids"]):
            raise ValueError(f"{path}: document {d['id']}: prompt_len {d['prompt_len']} outside 1..{len(d['ids']) - 1}")
    return sorted(docs, key=lambda d: d["id"])


def ensure_documents(
    model,
    tok,
    path: str | os.PathLike[str],
    n_docs: int,
    prompt_tokens: int = PROMPT_TOKENS,
    continuation_tokens: int = CONTINUATION_TOKENS,
) -> list[dict[str, Any]]:
    """The first ``n_docs`` documents of ``path``, generating (and appending) the missing ones."""
    docs = load_documents(path) if Path(path).exists() else []
    for d in docs:
        if d["n_tokens"] != prompt_tokens + continuation_tokens or d["prompt_len"] != prompt_tokens:
            raise ValueError(
                f"{path}: document {d['id']} has {d['n_tokens']} tokens with prompt_len {d['prompt_len']}, not "
                f"{prompt_tokens} + {continuation_tokens}; use another --texts file or the same lengths"
            )
    if len(docs) < n_docs:
        docs += generate_documents(model, tok, n_docs - len(docs), prompt_tokens, continuation_tokens, first=len(docs))
        write_atomic(path, "".join(dumps_row(d) + "\n" for d in docs))
    return docs[:n_docs]


def out_path(out: str | None, spec: str) -> Path:
    """The texts file a run writes: ``out``, or the user's folder (a run never extends the committed texts unless it
    names them)."""
    return Path(out) if out else USER_DIR / f"{model_tag(spec)}.jsonl"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="model spec (hfkv.loading.load_model; default smollm2)")
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("--dtype", default="fp32", help="dtype the text is generated in (default fp32)")
    ap.add_argument("--docs", type=int, default=4, help="number of documents (default 4; up to any number)")
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    ap.add_argument("--continuation-tokens", type=int, default=CONTINUATION_TOKENS)
    ap.add_argument(
        "--out",
        default=None,
        help=f"texts file (default {USER_DIR}/<model-tag>.jsonl under the working directory; the committed "
        f"{DEFAULT_DIR}/<model-tag>.jsonl only when named)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from hfkv.loading import load_model  # deferred: tests patch hfkv.loading.load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.docs < 1:
        raise SystemExit(f"--docs={args.docs} must be >= 1")
    model, tok = load_model(args.model, gguf_file=args.gguf_file, dtype=args.dtype)
    out = out_path(args.out, args.model)
    docs = ensure_documents(model, tok, out, args.docs, args.prompt_tokens, args.continuation_tokens)
    print(json.dumps({"path": str(out), "docs": len(docs), "tokens": [d["n_tokens"] for d in docs]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
