"""The configs selected by a global, a layer and a head study, on problems none of them calibrated on.

    .venv/bin/python calibration/holdout_granularity.py hfkv-out/calibrate/studies/smollm2-gran-{global,layer,head} \\
        --n-problems 6

compare_granularity.py reads the fronts on the calibration problems (in-sample). This evaluates each
study's selected trial (rebuilt from summary.json: base config + the trial's fields) and the base
preset on problems of the same data file that the studies did not use (the studies' own seed and
selection rule, the next ``--n-problems`` after their calibration problems), with the studies'
model and evaluation settings. Writes ``<out>.json`` and ``<out>.md``, by default under
``hfkv-out/holdout_granularity/``; the committed results are regenerated only by naming them
(``--out calibration/results/granularity-smollm2-holdout``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hfkv.atomic import write_atomic  # noqa: E402
from hfkv.calibration.data import load_jsonl, select  # noqa: E402
from hfkv.calibration.objectives import FidelityObjective  # noqa: E402
from hfkv.calibration.report import dump_json  # noqa: E402
from hfkv.config import TriStateConfig  # noqa: E402

DEFAULT_OUT = Path("hfkv-out/holdout_granularity/granularity-holdout")  # a user's folder, never calibration/results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("studies", nargs="+", type=Path, help="output folders of fidelity studies (summary.json)")
    p.add_argument("--n-problems", type=int, default=6, help="held-out problems (default: 6)")
    p.add_argument("--seed", type=int, default=0, help="seed the studies used for their selection (default: 0)")
    p.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output prefix: <out>.json, <out>.md (default: {DEFAULT_OUT})"
    )
    a = p.parse_args(argv)
    import torch

    from hfkv.loading import load_model

    torch.set_num_threads(1)
    summaries = [json.loads((f / "summary.json").read_text()) for f in a.studies]
    spec = summaries[0]["spec"]
    for s in summaries[1:]:
        for k in ("model", "dtype", "data", "evaluation", "base"):
            if s["spec"][k] != spec[k]:
                raise SystemExit(f"{s['study']}: {k} differs from {summaries[0]['study']}")
    rows = load_jsonl(spec["data"]["source"])
    n_cal = spec["data"]["n_problems"]
    # The studies calibrated on select(rows, n_cal, seed): the first n_cal after the shuffle. Holding out
    # n_cal + N and keeping the last N of them gives problems after those.
    held = select(rows, a.n_problems, a.seed, holdout=n_cal).calibration
    cal = select(rows, n_cal, a.seed).calibration
    assert all(h not in cal for h in held)
    ev = spec["evaluation"]
    model, tok = load_model(spec["model"], gguf_file=spec["gguf_file"], dtype=spec["dtype"])
    obj = FidelityObjective(model, tok, held, ev["chunk"], ev["max_solution_tokens"], ev["prompt"], ev["n_shots"])
    base = TriStateConfig.from_dict({**spec["base"], "provenance": {}})
    configs = [("full", TriStateConfig.from_preset("full")), (f"{base.name} (base preset)", base)]
    for s in summaries:
        sel = s["selected"]
        trial = next(t for t in s["trials"] if t["number"] == sel["number"])
        fields = trial.get("config") or {}
        if not fields:
            raise SystemExit(f"{s['study']}: summary.json lacks the selected trial's config fields")
        name = f"{s['spec']['space']['granularity']} (trial {sel['number']})"
        configs.append((name, TriStateConfig.from_dict({**spec["base"], **fields, "name": name, "provenance": {}})))
    results = []
    for name, cfg in configs:
        m = obj.evaluate(cfg).to_dict()
        results.append({"config": name, **m})
        print(f"{name}: kl={m['kl']:.4f} top1={m['top1']:.4f} memory={m['memory_ratio']:.4f}", flush=True)
    out = {"held_out": {"n": len(held), "seed": a.seed, "after": n_cal}, "evaluation": ev, "results": results}
    write_atomic(a.out.with_suffix(".json"), dump_json(out))
    lines = ["| config | kl | top1 | memory |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['config']} | {r['kl']:.4f} | {r['top1']:.4f} | {r['memory_ratio']:.4f} |" for r in results]
    write_atomic(a.out.with_suffix(".md"), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
