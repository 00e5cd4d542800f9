"""What a Walsh-Hadamard rotation of keys and values would buy a whole cache, at equal memory, before building it.

docs/formats.md ("Metadata variants") measures one quantized part at a time: an orthonormal rotation of each head
vector before the per-token groups (the ``rotated`` placement of eval/format_variants.py; QuaRot, TurboQuant's
rotation without its codebook) takes 16-19% off the key loss of int4 / int2 and 8% off the values'. This script asks
what that is worth end to end: teacher-forced KL and top-1 against the full cache (hfkv.evaluation.fidelity) of
each method as it is and with every compressed layer's keys, values and queries rotated (:func:`rotated_layers`).

The rotation is applied around the layer, not in the formats: ``update()`` stores ``H k`` and ``H v`` in every
tier and the window, ``attend()`` gets ``H q`` and returns ``H^T`` of its output, so the logits are the same up to
rounding (``(Hq).(Hk) = q.k``), the policy sees the same attention, and the quantized tiers hold rotated vectors.
The bytes held are the same; what changes is the error each format leaves. The cache's own option,
``TriStateConfig.rotate``, does the same around the layer, bit for bit (tests/test_eval_scripts.py); this study
rotates methods whatever their config says, which is how it was measured before the option existed.

    OMP_NUM_THREADS=2 python -m eval.archive.rotation_fidelity --docs 4 --budgets 128,256 --threads 2 \
        --out eval/archive/results/rotation_fidelity_smollm2.json   # the committed file; without --out: hfkv-out/eval/

Archived (eval/archive/README.md): its answer is docs/generate.md's rotation section, and the cache's own
``TriStateConfig.rotate`` (``hfkv:rotate=True``, measured by the sweeps) replaced this study's wrapper.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from hfkv.quant.rotation import hadamard, rotate  # noqa: E402

# a run's default output, under the working directory; the committed eval/archive/results/ only by --out
DEFAULT_OUT = Path("hfkv-out/eval/rotation_fidelity_smollm2.json")


@contextmanager
def rotated_layers():
    """Every :class:`hfkv.cache.TriStateLayer` stores rotated keys and values and attends with a rotated query,
    its output rotated back (module docstring), while the context is open."""
    from hfkv.cache import TriStateLayer

    update, attend = TriStateLayer.update, TriStateLayer.attend

    def rotated_update(self, key_states, value_states, *args, **kwargs):
        rot = hadamard(key_states.shape[-1], key_states.device)
        return update(self, rotate(key_states, rot), rotate(value_states, rot), *args, **kwargs)

    def rotated_attend(self, module, query, key, value, mask, scaling, out=None, computed=None):
        # ``computed``: a dense layer's output from the model's attention, over rotated keys and a query that is
        # not: left aside, attend() computes it again from the rotated query
        rot = hadamard(query.shape[-1], query.device)
        res = attend(self, module, rotate(query, rot), rotate(key, rot), rotate(value, rot), mask, scaling)
        res = rotate(res, rot)  # H is its own inverse
        return res if out is None else out.copy_(res)

    TriStateLayer.update, TriStateLayer.attend = rotated_update, rotated_attend
    try:
        yield
    finally:
        TriStateLayer.update, TriStateLayer.attend = update, attend


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="fp32", help="model dtype (default fp32, as eval/sweep_fidelity.py)")
    ap.add_argument("--docs", type=int, default=4, help="human-written documents (hfkv.evaluation.human_texts)")
    ap.add_argument("--methods", default="hfkv,quant@none,diffkv@none", help="method specs (comma-separated)")
    ap.add_argument(
        "--budgets",
        default="128,256",
        help="budgets per KV head for methods that take one (tokens, or full-precision-token equivalents for hfkv)",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="result file (default: %(default)s)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from hfkv.evaluation.fidelity import mean_fidelity, reference_logprobs, teacher_forced
    from hfkv.evaluation.human_texts import human_documents
    from hfkv.evaluation.methods import expand_methods
    from hfkv.evaluation.results import parse_list, provenance, script_command, write_result_json
    from hfkv.loading import load_model

    torch.set_num_threads(args.threads)
    methods, skipped = expand_methods(args.methods.split(","), parse_list(args.budgets))
    for spec, why in skipped:
        print(f"skipping {spec}: {why}", file=sys.stderr)
    model, tok = load_model(args.model, dtype=args.dtype)
    docs = human_documents(tok, args.docs)
    per: dict[tuple[str, bool], list] = {}
    t_all = time.perf_counter()
    for doc in docs:
        ids = torch.tensor([doc["ids"]])
        ref = reference_logprobs(model, ids, doc["prompt_len"])
        for method in methods:
            for rotated in (False, True):
                t0 = time.perf_counter()
                with rotated_layers() if rotated else nullcontext():
                    fid, _ = teacher_forced(
                        model, ids, doc["prompt_len"], lambda m=method, n=ids.shape[1]: m.make_cache(model, n), ref
                    )
                per.setdefault((method.label, rotated), []).append(fid)
                print(
                    f"doc {doc['id']} {method.label:<14} rotated={rotated!s:<5} kl={fid.kl:.4f} top1={fid.top1:.3f} "
                    f"mem={fid.memory_ratio:.3f} {time.perf_counter() - t0:.0f}s",
                    flush=True,
                )
    rows = []
    for (label, rotated), fids in per.items():
        m = mean_fidelity(fids)
        rows.append({"method": label, "rotated": rotated, "docs": len(fids), "kl_per_doc": [f.kl for f in fids],
                     **m.to_dict()})  # fmt: skip
    result = {
        "what": "teacher-forced KL / top-1 against the full cache on human-written documents, each method as it is "
        "and with keys, values and queries rotated by an orthonormal Walsh-Hadamard matrix "
        "(eval/archive/rotation_fidelity.py)",
        "model": args.model,
        "dtype": args.dtype,
        "texts": "human",
        "sources": [d["source"] for d in docs],
        "prompt_len": docs[0]["prompt_len"],
        "n_tokens": docs[0]["n_tokens"],
        "threads": args.threads,
        "wall_s": round(time.perf_counter() - t_all, 1),
        "rows": rows,
        "command": script_command("eval/archive/rotation_fidelity.py", argv),
        **provenance(),
    }
    write_result_json(args.out, result)
    for r in rows:
        print(f"{r['method']:<14} rotated={r['rotated']!s:<5} kl={r['kl']:.4f} top1={r['top1']:.3f} "
              f"mem={r['memory_ratio']:.3f}")  # fmt: skip
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
