"""How often a policy run changes the shape of a layer's storage: what a whole-step CUDA graph must survive.

``hfkv.graphs.GraphedDecoder(mode="steps")`` replays one graph of a whole decode step, which bakes in every
layer's page tables and pool; it keeps its graph across a policy run only where no layer's pool or table
changed shape (``TriStateLayer.launch_signature``), and captures again otherwise (an eager step's host time).
This decodes a real model on a human-written document and counts, for every policy run, the layers whose
pool or any tier's table changed shape, and how (pool grown, table widened, table narrowed). A run where no
layer changed is one a whole-step graph survives; ``mode="layers"`` survives every run by construction.

Counts, not times: any machine, no quiet needed. Every policy run happens on every layer at the same step.

    python eval/storage_churn.py --out eval/results/storage_churn_smollm2.json
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch


def _shapes(layer) -> tuple:
    tiers = layer.tiers
    if tiers is None:  # a layer holding its sequence dense (hfkv.layer.dense) has no pool or tables yet
        return ()
    return (tuple(tiers.pool.data.shape), *(tuple(t.shape) for t in tiers.tables))


def measure(model, tok, method: str, context: int, steps: int) -> dict[str, Any]:
    """Per policy run: layers whose storage changed shape, and the kinds of change summed over layers."""
    from hfkv.evaluation.bench import decode_step
    from hfkv.evaluation.human_texts import human_documents
    from hfkv.evaluation.methods import parse_method

    spec = parse_method(method)
    doc = human_documents(tok, 1, prompt_tokens=context, continuation_tokens=8)[0]
    ids = torch.tensor([doc["ids"][:context]])
    cache = spec.make_cache(model, max_cache_len=context + steps + 1)
    runs: list[dict[str, int]] = []
    with torch.inference_mode():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1:].argmax(-1)
        before = [_shapes(layer) for layer in cache.layers]
        for i in range(steps):
            nxt = decode_step(model, cache, nxt, context + i)
            if cache.layers[0].steps_since_policy != 0:
                continue
            now = [_shapes(layer) for layer in cache.layers]
            run = {"layers_changed": sum(a != b for a, b in zip(before, now, strict=True)),
                   "pool_grown": 0, "table_widened": 0, "table_narrowed": 0}  # fmt: skip
            for a, b in zip(before, now, strict=True):
                run["pool_grown"] += a[0] != b[0]
                for x, y in zip(a[1:], b[1:], strict=True):
                    run["table_widened"] += y[-1] > x[-1]
                    run["table_narrowed"] += y[-1] < x[-1]
            runs.append(run)
            before = now
    n = len(runs)
    return {
        "method": spec.label,
        "source": doc["source"],
        "context": context,
        "decode_steps": steps,
        "layers": len(cache.layers),
        "policy_runs": n,
        "runs_changing_no_layer": sum(r["layers_changed"] == 0 for r in runs),
        "mean_layers_changed_per_run": sum(r["layers_changed"] for r in runs) / max(n, 1),
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    from hfkv import cli_args as ca
    from hfkv.evaluation.results import provenance, script_command, write_result_json
    from hfkv.loading import load_model

    ap = ca.ArgumentParser(prog="eval/storage_churn.py", description=__doc__.splitlines()[0], epilog=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", default="smollm2", help="model spec for hfkv.loading (default: %(default)s)")
    ap.add_argument("--method", default="hfkv@256", help="method spec (default: %(default)s)")
    ap.add_argument("--context", type=ca.integer(16), default=2048, help="prompt tokens (default 2048)")
    ap.add_argument("--steps", type=ca.integer(1), default=320, help="decode steps (default 320)")
    ap.add_argument("--out", type=Path, required=True, help="result file")
    args = ap.parse_or_report(argv)
    if args is None:
        return 2
    model, tok = load_model(args.model, dtype="float32")
    result = measure(model, tok, args.method, args.context, args.steps)
    result |= {
        "model": args.model,
        "what": "per policy run, the layers whose pool or page tables changed shape (eval/storage_churn.py)",
        "command": script_command("eval/storage_churn.py", argv),
        **provenance(),
    }
    write_result_json(args.out, result)
    print(
        f"{result['policy_runs']} policy runs of {result['layers']} layers: {result['runs_changing_no_layer']} changed "
        f"no layer's storage shape, {result['mean_layers_changed_per_run']:.1f} layers changed per run on average\n"
        f"wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
