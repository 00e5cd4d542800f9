"""Cheaper metadata for the integer tiers: where their scales live and how precise they are, per byte.

docs/formats.md chose the quantized tier (K4V2, group 32) among the formats hfkv stores. At
head_dim 64 the fp16 scale and zero of each group, and the 8 bytes of tag and score, are a third
of a K4V2 record, so this script measures what other placements of that metadata would keep:

- ``token``: one scale/zero per group of ``g`` elements of one token (what hfkv stores), with the
  scale and zero in fp16, bf16 or fp32;
- ``page``: the same groups, one scale/zero per group position shared by a block of ``T`` tokens
  (a page), 4 * G / T bytes per token instead of 4 * G;
- ``channel``: KIVI-style, one scale/zero per channel over a block of ``T`` tokens (4 * D / T bytes
  per token), which follows the outlier channels of keys;
- ``rotated``: ``token``'s groups after an orthonormal Walsh-Hadamard rotation of each token's head vector
  (QuaRot, TurboQuant's random rotation without its codebook): the same bytes per token, the outlier channels
  spread over every element before the groups take their ranges. Attention reads it at no per-slot cost: the
  logits are unchanged if the query is rotated the same way (``(Hq).(Hk) = q.k``), and the output of rotated
  values is rotated back once per query (``H^T sum p (Hv)``).

Each variant is fake-quantized on a real model's own keys and values and scored with the relative
loss of ``format_fidelity.part_losses`` (attention-weighted output error of quantizing a part,
relative to evicting the token). A record's bytes are ``codes + metadata + 8`` (tag and score), or
``+ 4`` for the narrower slot metadata the last table considers (int16 position offset, fp16 score).

    python -m eval.format_variants --model smollm2 --dtype bf16 --out eval/results/format_variants_smollm2.json
    python -m eval.format_variants --model testbed --dtype bf16 --out eval/results/format_variants_testbed.json
    python -m eval.format_variants --model smollm2 --dtype bf16 --texts human --docs 4 \
        --out eval/results/format_variants_smollm2_human.json   # human-written documents (hfkv.evaluation.human_texts)

Without ``--out`` a run writes ``hfkv-out/eval/format_variants_<model>.json`` under the working directory.

Run from the repository root as ``python -m eval.format_variants``: it imports ``eval.format_fidelity`` of this
package (a plain ``python -m eval.format_variants`` puts only its own folder on the import path, which does not
reach them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from eval.format_fidelity import _texts, capture_qkv, part_losses, run_meta  # noqa: E402
from hfkv.quant.rotation import hadamard  # noqa: E402

OUT_DIR = Path("hfkv-out/eval")  # a run's default folder, under the working directory; eval/results/ only by --out

META_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# (bits, placement, group or block, scale dtype)
VARIANTS = [
    (bits, "token", 32, meta) for bits in (4, 2) for meta in ("fp16", "bf16", "fp32")
] + [
    (bits, place, block, "fp16") for bits in (4, 2) for place in ("page", "channel") for block in (16, 32, 64)
] + [
    (bits, "rotated", 32, "fp16") for bits in (4, 2)
]  # fmt: skip


def _round_up(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The stored scale, rounded up so the top code still reaches the max (as hfkv's encoder does)."""
    s = scale.to(dtype)
    return torch.where(s.float() < scale, torch.nextafter(s, torch.full_like(s, torch.inf)), s).float()


def fake_quant(x: torch.Tensor, bits: int, place: str, size: int, meta: str) -> torch.Tensor:
    """Quantize-dequantize ``x [H, T, D]`` (fp32) with min/max groups placed as ``place`` describes."""
    h, t, d = x.shape
    qmax = (1 << bits) - 1
    if place == "rotated":  # token groups in the rotated space, rotated back
        rot = hadamard(d)
        return fake_quant(x @ rot, bits, "token", size, meta) @ rot
    if place == "token":
        xg = x.reshape(h, t, d // size, size)
        dims = (-1,)
    else:
        block = size
        pad = (-t) % block
        xp = torch.cat([x, x[:, -1:].expand(h, pad, d)], 1) if pad else x  # the last page repeats its last token
        if place == "page":
            xg = xp.reshape(h, -1, block, d // 32, 32)
            dims = (2, 4)
        else:
            xg = xp.reshape(h, -1, block, d)
            dims = (2,)
    mn, mx = xg.amin(dims, keepdim=True), xg.amax(dims, keepdim=True)
    dtype = META_DTYPES[meta]
    zero = mn.to(dtype).float()
    scale = torch.where(mx > mn, _round_up((mx - zero) / qmax, dtype), 0.0)
    codes = torch.where(scale > 0, torch.round((xg - zero) / torch.where(scale > 0, scale, 1.0)), 0.0).clamp(0, qmax)
    out = codes * scale + zero
    if place == "token":
        return out.reshape(h, t, d)
    return out.reshape(h, -1, d)[:, :t]


def metadata_bytes(place: str, size: int, meta: str, dim: int) -> float:
    """Scale + zero bytes per token and head."""
    width = 2 * torch.empty((), dtype=META_DTYPES[meta]).element_size()
    if place in ("token", "rotated"):
        return width * dim // size
    if place == "page":
        return width * (dim // 32) / size
    return width * dim / size


def label(bits: int, place: str, size: int, meta: str) -> str:
    return f"int{bits}/{place}/{size}/{meta}"


def out_path(args: argparse.Namespace) -> Path:
    """``--out``, or the default file of ``--model`` under the working directory."""
    return Path(args.out) if args.out else OUT_DIR / f"format_variants_{args.model}.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument(
        "--texts", default="model", choices=["model", "human"],
        help="model: the model's generated documents (default); human: human-written ones, cut at run time",
    )  # fmt: skip
    ap.add_argument("--prompt-len", type=int, default=0)
    ap.add_argument("--observers", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help=f"result file (default {OUT_DIR}/format_variants_<model>.json)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from hfkv.atomic import write_atomic
    from hfkv.loading import load_model, parse_dtype

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype=args.dtype)
    dtype = parse_dtype(args.dtype) or model.dtype
    text = model.config.get_text_config(decoder=True)
    dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    variants = [v for v in VARIANTS if v[2] <= dim or v[1] != "token"]
    quantizers = {label(*v): (lambda x, v=v: fake_quant(x.to(dtype).float(), *v)) for v in variants}
    losses: dict[str, float] = {}
    if args.texts == "human":
        from hfkv.evaluation.human_texts import human_documents

        docs = human_documents(tok, args.docs)
        if args.prompt_len:
            docs = [{**d, "prompt_len": args.prompt_len} for d in docs]
    else:
        docs = _texts(args.model, tok, args.docs, args.prompt_len)
    for d in docs:
        qkv = capture_qkv(model, torch.tensor([d["ids"][: d["prompt_len"]]]))
        for key, val in part_losses(qkv, args.observers, dtype, quantizers).items():
            losses[key] = losses.get(key, 0.0) + val / len(docs)
    rows = []
    for bits, place, size, meta in VARIANTS:
        name = label(bits, place, size, meta)
        if f"K:{name}" not in losses:
            continue
        rows.append(
            {
                "bits": bits,
                "placement": place,
                "size": size,
                "meta": meta,
                "code_bytes": dim * bits // 8,
                "meta_bytes": metadata_bytes(place, size, meta, dim),
                "loss_keys": losses[f"K:{name}"],
                "loss_values": losses[f"V:{name}"],
            }
        )
        r = rows[-1]
        size = r["code_bytes"] + r["meta_bytes"]
        print(f"{name:28s} bytes {size:6.1f} K {r['loss_keys']:.4f} V {r['loss_values']:.4f}")
    command = "python -m eval.format_variants " + " ".join(argv if argv is not None else sys.argv[1:])
    meta_info = run_meta(args, dim, len(docs)) | {
        "command": command,
        "texts": "human" if args.texts == "human" else ("kv_recall" if args.model == "testbed" else "model"),
    }
    out = out_path(args)
    write_atomic(out, json.dumps({"meta": meta_info, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
