"""Calibration of the tri-state policy (``hfkv calibrate``): an Optuna study over alpha_h / alpha_l.

Python API (the CLI is a thin layer over it):

    from hfkv.calibration import load_problems, select, generate_solutions, FidelityObjective, SearchSpace
    rows, source = load_problems("calibration/data/math_fixture.jsonl")
    sel = select(rows, n_problems=16, seed=0)
    sols = generate_solutions(model, tok, sel.calibration, max_new_tokens=1024)   # the model's own, once
    objective = FidelityObjective(model, tok, sel.calibration, solutions=sols)
    objective.evaluate(TriStateConfig.from_preset("diffkv")).to_dict()   # kl, top1, memory_ratio, ...

See docs/calibration.md for the study design, storage and scale-out.
"""

from hfkv.calibration.answers import answers_match, last_boxed, solution_answer
from hfkv.calibration.data import DataUnavailableError, Problem, data_hash, load_jsonl, load_problems, select
from hfkv.calibration.granularity import alpha_tables, head_statistics
from hfkv.calibration.objectives import (
    AccuracyObjective,
    Evaluation,
    FidelityObjective,
    generate_solutions,
    prompt_text,
)
from hfkv.calibration.search import SearchSpace

__all__ = [
    "AccuracyObjective",
    "DataUnavailableError",
    "Evaluation",
    "FidelityObjective",
    "Problem",
    "SearchSpace",
    "alpha_tables",
    "answers_match",
    "data_hash",
    "generate_solutions",
    "head_statistics",
    "last_boxed",
    "load_jsonl",
    "load_problems",
    "prompt_text",
    "select",
    "solution_answer",
]
