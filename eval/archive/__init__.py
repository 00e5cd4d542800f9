"""Finished experiments of ``eval/``: scripts whose question has its answer in a docs section (eval/archive/README.md).

They still run (``python -m eval.archive.<script>``, or ``python eval/archive/<script>.py``) and their tests still
run, so they can be re-run on later code; their committed results are under ``eval/archive/results/``, beside the
superseded snapshots of the current scripts' results, and eval/README.md renders none of them.
"""
