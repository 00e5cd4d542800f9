"""Fidelity per byte of the quantized formats hfkv can store: which tier is worth its bytes.

Two measurements on a real model's own keys, values and queries (SmolLM2-135M by default, on the
project's generated texts; or the testbed on its test prompts):

1. **Relative loss per part** (the weights of the memory-budget policy, ``hfkv.quant.fidelity``):
   for the prompt's last ``--observers`` queries ``q`` and every key ``i`` with attention ``p_qi``,
   quantizing keys moves the output by about ``p_qi |d_qi| |v_i - o_q|`` (``d_qi = q.(k^_i - k_i) *
   scale``, the logit error) and quantizing values by ``p_qi |v^_i - v_i|``; evicting the token moves
   it by ``p_qi |v_i - o_q|``. The loss of a part is the ratio of the sums (quantizing / evicting),
   so ``1 - loss_K - loss_V`` is the share of a token's worth a tier keeps.
2. **End to end**: teacher-forced KL and top-1 agreement (``hfkv.evaluation.fidelity``) of the
   ``quant`` preset (every token outside the window in the format, nothing evicted) against the
   memory it holds, per format pair: the fidelity-per-byte table of docs/formats.md.

    python eval/format_fidelity.py --model smollm2 --dtype bf16 --out eval/results/formats_smollm2.json
    python eval/format_fidelity.py --model testbed --dtype bf16 --out eval/results/formats_testbed.json
    python eval/format_fidelity.py --docs-only    # docs/formats.md from the committed JSON files

Without ``--out`` a run writes ``hfkv-out/eval/formats_<model>.json`` under the working directory and leaves
docs/formats.md alone; a run into ``eval/results/`` (the committed files) rewrites it, as ``--docs-only`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

PARTS_FORMATS = [("int8", 32), ("int8", 64), ("fp8", 0), ("int4", 32), ("int4", 64), ("int4", 128), ("int2", 32)]
PARTS_FORMATS += [("int2", 64), ("int2", 128)]
# (key, value, group): the stored pairs worth comparing (DiffKV's K8V4 / K4V2, and the symmetric ones).
PAIRS = [
    ("int8", "int8", 64),
    ("int8", "int4", 32),
    ("int8", "int4", 64),
    ("int4", "int4", 32),
    ("int4", "int4", 64),
    ("int4", "int4", 128),
    ("int4", "int2", 32),
    ("int4", "int2", 64),
    ("int2", "int2", 32),
    ("int2", "int2", 64),
    ("fp8", "fp8", 32),
]
REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "formats.md"
RESULTS = REPO / "eval" / "results"  # the committed result files docs/formats.md is made from
OUT_DIR = Path("hfkv-out/eval")  # a run's default folder, under the working directory; eval/results/ only by --out


def capture_qkv(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer ``(query [Hq, T, D], key [Hkv, T, D], value)`` (post-RoPE) of one forward over ``ids [1, T]``."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen: list = []

    def capture(module, query, key, value, attention_mask, **kw):
        seen.append((query[0].float(), key[0].float(), value[0].float()))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("hfkv_capture", capture)
    previous = model.config._attn_implementation
    model.set_attn_implementation("hfkv_capture")
    try:
        with torch.inference_mode():
            model(input_ids=ids)
    finally:
        model.set_attn_implementation(previous)
    return seen


def stored_quantizers(dim: int, dtype: torch.dtype) -> dict:
    """``{"int4/32": round trip, ...}``: hfkv's own encode/decode of every format of PARTS_FORMATS."""
    from hfkv.quant.formats import QuantFormat

    out = {}
    for f, grp in PARTS_FORMATS:
        fmt = QuantFormat(f, dim, min(grp, dim) if grp else 32, dtype)
        out[f"{f}/{grp}"] = lambda x, fmt=fmt: fmt.decode(fmt.encode(x.to(dtype)), torch.float32)
    return out


def part_losses(qkv, observers: int, dtype: torch.dtype, quantizers: dict | None = None) -> dict[str, float]:
    """``{"K:int4/64": loss, "V:int2/32": loss, ...}`` summed over layers (ratio of attention-weighted sums).

    ``quantizers``: name -> round trip of ``[H, T, D]`` fp32 (default: the stored formats).
    """
    quantizers = quantizers or stored_quantizers(qkv[0][1].shape[-1], dtype)
    num = {f"{p}:{name}": 0.0 for p in "KV" for name in quantizers}
    den = 0.0
    for q, k, v in qkv:
        hq, t, d = q.shape
        hkv = k.shape[0]
        g = hq // hkv
        w = min(observers, t)
        qo = q[:, t - w :]  # [Hq, w, D]
        kk, vv = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)  # [Hq, T, D]
        logits = qo @ kk.transpose(-1, -2) * d**-0.5
        causal = torch.arange(t) <= torch.arange(t - w, t).unsqueeze(-1)
        p = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)  # [Hq, w, T]
        o = p @ vv  # [Hq, w, D]
        dist = (vv.unsqueeze(1) - o.unsqueeze(2)).norm(dim=-1)  # [Hq, w, T]: |v_i - o_q|
        den += float((p * dist).sum())
        for name, roundtrip in quantizers.items():
            kq = roundtrip(k).repeat_interleave(g, 0)
            vq = roundtrip(v).repeat_interleave(g, 0)
            dlog = (qo @ (kq - kk).transpose(-1, -2)) * d**-0.5  # logit error [Hq, w, T]
            num[f"K:{name}"] += float((p * dlog.abs() * dist).sum())
            num[f"V:{name}"] += float((p * (vq - vv).norm(dim=-1).unsqueeze(1)).sum())
    return {key: val / den for key, val in num.items()}


def end_to_end(model, docs, chunk: int) -> list[dict]:
    """Teacher-forced KL / top-1 / memory of the ``quant`` preset per format pair, plus DynamicCache-sized refs."""
    import hfkv
    from hfkv.evaluation.fidelity import mean_fidelity, reference_logprobs, teacher_forced

    seqs = [(torch.tensor([d["ids"]]), d["prompt_len"]) for d in docs]
    refs = [reference_logprobs(model, ids, n, chunk) for ids, n in seqs]
    rows = []
    for key, value, group in PAIRS:
        cfg = hfkv.TriStateConfig.from_preset("quant", quantized={"key": key, "value": value, "group_size": group})
        t0 = time.perf_counter()
        res = [
            teacher_forced(model, ids, n, lambda cfg=cfg: hfkv.TriStateCache(model, cfg), ref, chunk)[0]
            for (ids, n), ref in zip(seqs, refs, strict=True)
        ]
        f = mean_fidelity(res)
        rows.append({"key": key, "value": value, "group": group, **f.to_dict(), "seconds": time.perf_counter() - t0})
        print(f"  K{key}/V{value} g{group}: memory {f.memory_ratio:.3f} KL {f.kl:.4f} top1 {f.top1:.3f}", flush=True)
    return rows


def _texts(spec: str, tok, n_docs: int, prompt_len: int) -> list[dict]:
    if spec == "testbed":
        from hfkv.testbed import load_test_set

        docs = []
        for i, row in enumerate(load_test_set("kv_recall")[:n_docs]):
            ids = tok(row["prompt"] + row["target"] + "\n")["input_ids"]
            docs.append({"id": i, "ids": ids, "prompt_len": len(tok(row["prompt"])["input_ids"])})
        return docs
    from hfkv.evaluation.texts import default_path, load_documents

    path = default_path(spec)
    if not path.exists():
        raise SystemExit(f"no texts for {spec!r} at {path}: run `python -m hfkv.evaluation.texts --model {spec}`")
    docs = load_documents(path)[:n_docs]
    return [{**d, "prompt_len": prompt_len or d["prompt_len"]} for d in docs]


def run_meta(args: argparse.Namespace, dim: int, docs: int) -> dict:
    """What a result file records about its run (the docs' section headers read it)."""
    return {
        "model": args.model,
        "dtype": args.dtype,
        "head_dim": dim,
        "docs": docs,
        "observers": args.observers,
        "machine": f"{platform.machine()} CPU, torch {torch.__version__}",
    }


def write_docs(results: list[dict], path: Path = DOCS) -> None:
    """docs/formats.md from result files: one section per model (parts table, pairs table)."""
    from hfkv.atomic import write_atomic

    lines = [
        "# Quantized tier formats: fidelity per byte",
        "",
        "Generated by `python eval/format_fidelity.py --docs-only` from `eval/results/formats_*.json`; do not edit.",
        "What each format keeps of a token's worth (the weights of the memory-budget policy,",
        "`hfkv.quant.fidelity`) and what a whole cache in that format costs and loses (`quant` preset,",
        "nothing evicted). Record bytes include the 8 bytes of tag and score every slot carries; groups",
        "larger than head_dim are clamped to it, so only distinct formats are listed.",
        "",
    ]
    for res in results:
        m = res["meta"]
        lines += [f"## {m['model']} ({m['dtype']}, head_dim {m['head_dim']})", ""]
        lines += [f"{m['docs']} sequences, {m['observers']} observing queries per layer; {m['machine']}.", ""]
        lines += ["| part | format | group | relative loss |", "|---|---|---|---|"]
        for key, val in sorted(res["parts"].items()):
            part, fg = key.split(":")
            f, g = fg.split("/")
            if int(g) > m["head_dim"]:
                continue  # clamped to head_dim: the same format as group = head_dim
            lines.append(f"| {'keys' if part == 'K' else 'values'} | {f} | {g if g != '0' else '-'} | {val:.4f} |")
        lines += [
            "",
            "| keys | values | group | record bytes | memory vs DynamicCache | KL | top-1 |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in sorted(res["pairs"], key=lambda r: r["memory_ratio"]):
            if r["group"] > m["head_dim"]:
                continue
            lines.append(
                f"| {r['key']} | {r['value']} | {r['group']} | {r['record_bytes']} | {r['memory_ratio']:.3f} | "
                f"{r['kl']:.4f} | {r['top1']:.3f} |"
            )
        lines.append("")
    lines += variant_sections(sorted(RESULTS.glob("format_variants_*.json")))
    write_atomic(path, "\n".join(lines))


def variant_sections(paths: list[Path]) -> list[str]:
    """Where the integer tiers' scales could live, per model (``eval/format_variants.py``)."""
    if not paths:
        return []
    lines = [
        "## Metadata variants of the integer tiers",
        "",
        "From `eval/results/format_variants_*.json` (`python -m eval.format_variants --out",
        "eval/results/format_variants_<model>.json`): the relative loss",
        "of a part (as above) when its scale and zero are stored per token and group of 32 (`token`, what",
        "hfkv stores), one per group position shared by a block of tokens (`page`), or one per channel",
        "over a block of tokens (`channel`, KIVI), or per token and group of 32 after an orthonormal",
        "Walsh-Hadamard rotation of the head vector (`rotated`: QuaRot, TurboQuant's rotation without its",
        "codebook; attention then rotates the query and the output once per query, not per slot); bytes are per",
        "token and head, codes + scale/zero.",
        "",
    ]
    for path in paths:
        res = json.loads(path.read_text())
        m = res["meta"]
        names = {"human": "human-written", "model": "model-generated", "kv_recall": "kv_recall"}
        texts = names.get(m.get("texts", "model"), m.get("texts"))
        lines += [f"### {m['model']} ({m['dtype']}, head_dim {m['head_dim']}, {m['docs']} {texts} sequences)", ""]
        lines += ["| bits | placement | group / block | scale dtype | bytes | key loss | value loss |"]
        lines += ["|---|---|---|---|---|---|---|"]
        for r in res["rows"]:
            lines.append(
                f"| {r['bits']} | {r['placement']} | {r['size']} | {r['meta']} | "
                f"{r['code_bytes'] + r['meta_bytes']:.1f} | {r['loss_keys']:.4f} | {r['loss_values']:.4f} |"
            )
        lines.append("")
    return lines


def out_path(args: argparse.Namespace) -> Path:
    """``--out``, or the default file of ``--model`` under the working directory."""
    return Path(args.out) if args.out else OUT_DIR / f"formats_{args.model}.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=0, help="override the texts' prompt length (0: keep)")
    ap.add_argument("--observers", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=1)
    ap.add_argument("--out", default=None, help=f"result file (default {OUT_DIR}/formats_<model>.json)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--docs-only", action="store_true", help="only rewrite docs/formats.md from eval/results")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not args.docs_only:
        from hfkv.atomic import write_atomic
        from hfkv.loading import load_model, parse_dtype
        from hfkv.quant.formats import QuantFormat
        from hfkv.quant.record import RecordLayout

        torch.set_num_threads(args.threads)
        model, tok = load_model(args.model, dtype=args.dtype)
        docs = _texts(args.model, tok, args.docs, args.prompt_len)
        text = model.config.get_text_config(decoder=True)
        dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        dtype = parse_dtype(args.dtype) or model.dtype
        losses: dict[str, float] = {}
        for d in docs:
            qkv = capture_qkv(model, torch.tensor([d["ids"][: d["prompt_len"]]]))
            for key, val in part_losses(qkv, args.observers, dtype).items():
                losses[key] = losses.get(key, 0.0) + val / len(docs)
        pairs = end_to_end(model, docs, args.chunk)
        for r in pairs:
            g = min(r["group"], dim)
            r["record_bytes"] = RecordLayout(
                QuantFormat(r["key"], dim, g, dtype), QuantFormat(r["value"], dim, g, dtype)
            ).nbytes
        meta = run_meta(args, dim, len(docs))
        out = out_path(args)
        write_atomic(out, json.dumps({"meta": meta, "parts": losses, "pairs": pairs}, indent=1) + "\n")
        print(f"wrote {out}")
        if not out.resolve().is_relative_to(RESULTS):  # a run of the user's: the committed page stays as it is
            return 0
    results = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("formats_*.json"))]
    write_docs(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
