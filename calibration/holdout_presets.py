"""Shipped presets at chosen budgets on a study's held-out problems, beside its calibrated config.

`hfkv calibrate --holdout` matches each preset's memory by a short budget search; when that search
cannot reach the calibrated config's memory in its few steps, this evaluates the presets at the
budgets you name instead, on the same held-out problems and the same teacher-forced protocol:

    python calibration/holdout_presets.py calibration/studies/smollm2-math \\
        --configs configs/calibrated/smollm2-math.yaml hfkv@64 hfkv@70 --holdout 4

writes ``hfkv-out/holdout_presets/holdout-presets.{json,md}`` by default; the committed results are
regenerated only by naming them (``--out calibration/results/smollm2-math-holdout-presets``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from hfkv.atomic import write_atomic  # noqa: E402
from hfkv.calibration.data import load_jsonl, select  # noqa: E402
from hfkv.calibration.objectives import FidelityObjective  # noqa: E402
from hfkv.calibration.report import dump_json  # noqa: E402
from hfkv.evaluation.methods import build_config, parse_budget  # noqa: E402

DEFAULT_OUT = Path("hfkv-out/holdout_presets/holdout-presets")  # a user's folder, never calibration/results


def _config(spec: str):
    if spec.endswith((".yaml", ".yml")):
        return build_config(spec)
    name, _, budget = spec.partition("@")
    return build_config(name, parse_budget(budget)) if budget else build_config(name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("study", type=Path, help="output folder of a fidelity study (summary.json)")
    p.add_argument("--configs", nargs="+", required=True, help="calibrated YAML files and preset@budget specs")
    p.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output prefix: <out>.json, <out>.md (default: {DEFAULT_OUT})"
    )
    p.add_argument("--seed", type=int, default=0, help="the study's --seed (default: 0)")
    p.add_argument("--holdout", type=int, required=True, help="the study's --holdout")
    a = p.parse_args(argv)
    import torch

    from hfkv.loading import load_model

    torch.set_num_threads(1)
    spec = json.loads((a.study / "summary.json").read_text())["spec"]
    data = spec["data"]
    held = select(load_jsonl(data["source"]), data["n_problems"], a.seed, holdout=a.holdout).holdout
    ev = spec["evaluation"]
    model, tok = load_model(spec["model"], gguf_file=spec["gguf_file"], dtype=spec["dtype"])
    obj = FidelityObjective(model, tok, held, ev["chunk"], ev["max_solution_tokens"], ev["prompt"], ev["n_shots"])
    results = []
    for name in a.configs:
        m = obj.evaluate(_config(name)).to_dict()
        results.append({"config": name, **m})
        print(f"{name}: kl={m['kl']:.4f} top1={m['top1']:.4f} memory={m['memory_ratio']:.4f}", flush=True)
    write_atomic(a.out.with_suffix(".json"), dump_json({"held_out": len(held), "evaluation": ev, "results": results}))
    lines = ["| config | kl | top1 | memory |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['config']} | {r['kl']:.4f} | {r['top1']:.4f} | {r['memory_ratio']:.4f} |" for r in results]
    write_atomic(a.out.with_suffix(".md"), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
