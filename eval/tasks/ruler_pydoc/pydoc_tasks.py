"""lm-eval's hooks for the ``*_pydoc`` tasks of this folder: RULER's essay-haystack tasks with the Python
language reference as the haystack, built at run time by hfkv.evaluation.ruler_pydoc (see that module)."""

from lm_eval.tasks.ruler.common_utils import aggregate_metrics, process_results

from hfkv.evaluation.ruler_pydoc import task_dataset

__all__ = ["aggregate_metrics", "process_results"]


def niah_single_2(**kwargs):
    return task_dataset("niah_single_2", **kwargs)


def niah_single_3(**kwargs):
    return task_dataset("niah_single_3", **kwargs)


def niah_multikey_1(**kwargs):
    return task_dataset("niah_multikey_1", **kwargs)


def niah_multivalue(**kwargs):
    return task_dataset("niah_multivalue", **kwargs)


def niah_multiquery(**kwargs):
    return task_dataset("niah_multiquery", **kwargs)
