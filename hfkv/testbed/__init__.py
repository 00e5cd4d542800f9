"""The testbed: a tiny Llama model trained by hfkv on synthetic retention tasks, shipped in the repo.

``TESTBED_PATH`` is the directory of the shipped model and tokenizer (loads offline with
``AutoModelForCausalLM.from_pretrained(TESTBED_PATH)`` / ``AutoTokenizer.from_pretrained``).
The task generators, scorers and test sets are in ``hfkv.testbed.tasks`` (re-exported here
lazily, so that ``python -m hfkv.testbed.tasks`` runs cleanly); how accuracy is measured on them
(generate, stop, extract, score) in ``hfkv.testbed.protocol``. See ``docs/testbed.md``.
"""

from __future__ import annotations

import importlib
import os

TESTBED_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model")

_TASK_EXPORTS = ("STOP", "TASKS", "TEST_SEEDS", "Task", "load_test_set", "test_set", "write_test_sets")


def __getattr__(name: str):
    if name in _TASK_EXPORTS:
        return getattr(importlib.import_module("hfkv.testbed.tasks"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_testbed(dtype=None):
    """(model, tokenizer) of the shipped testbed, loaded offline from ``TESTBED_PATH``."""
    # deferred: keeps hfkv demo --help from importing transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"dtype": dtype} if dtype is not None else {}
    model = AutoModelForCausalLM.from_pretrained(TESTBED_PATH, **kwargs)
    tok = AutoTokenizer.from_pretrained(TESTBED_PATH)
    model.eval()
    return model, tok


__all__ = ["TESTBED_PATH", "load_testbed", *_TASK_EXPORTS]
