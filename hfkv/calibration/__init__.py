"""Calibration of the tri-state policy (``hfkv calibrate``): an Optuna study over alpha_h / alpha_l.

Python API (the CLI is a thin layer over it):

    from hfkv.calibration import load_problems, select, generate_solutions, FidelityObjective, SearchSpace
    rows, source = load_problems("calibration/data/math_fixture.jsonl")
    sel = select(rows, n_problems=16, seed=0)
    sols = generate_solutions(model, tok, sel.calibration, max_new_tokens=1024)   # the model's own, once
    objective = FidelityObjective(model, tok, sel.calibration, solutions=sols)
    objective.evaluate(TriStateConfig.from_preset("diffkv")).to_dict()   # kl, top1, memory_ratio, ...

See docs/calibration.md for the study design, storage and scale-out.

The public names are imported on first use (PEP 562), as in :mod:`hfkv`: ``hfkv calibrate --help`` imports this
package (its parser reads :mod:`hfkv.calibration.data`) and must load neither torch nor optuna.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hfkv.lazy import lazy_names

# public name -> the module that defines it
_LAZY = {
    "answers_match": "hfkv.calibration.answers",
    "last_boxed": "hfkv.calibration.answers",
    "solution_answer": "hfkv.calibration.answers",
    "DataUnavailableError": "hfkv.calibration.data",
    "Problem": "hfkv.calibration.data",
    "data_hash": "hfkv.calibration.data",
    "load_jsonl": "hfkv.calibration.data",
    "load_problems": "hfkv.calibration.data",
    "select": "hfkv.calibration.data",
    "alpha_tables": "hfkv.calibration.granularity",
    "head_statistics": "hfkv.calibration.granularity",
    "AccuracyObjective": "hfkv.calibration.objectives",
    "Evaluation": "hfkv.calibration.objectives",
    "FidelityObjective": "hfkv.calibration.objectives",
    "generate_solutions": "hfkv.calibration.objectives",
    "prompt_text": "hfkv.calibration.objectives",
    "SearchSpace": "hfkv.calibration.search",
}

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

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ imports them
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


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals(), __all__)
