"""RULER's offline tasks through ``hfkv eval`` (lm-eval's own task code, data generated offline with the
model's tokenizer) and through the shared-prefill runner of eval/sweep_ruler.py, at toy size on the testbed."""

from __future__ import annotations

import json

import pytest

from hfkv.cli import main as hfkv_main

pytest.importorskip("wonderwords")
LENGTH = 512  # the shortest niah_single_1 prompt that leaves room for 128 generated tokens


@pytest.mark.slow
def test_hfkv_eval_runs_ruler_offline(tmp_path):
    argv = ["eval", "--model_args", "pretrained=testbed,hfkv_config=hfkv@64,mid=none", "--tasks", "niah_single_1"]
    argv += ["--metadata", json.dumps({"max_seq_lengths": [LENGTH]}), "--limit", "2", "--batch_size", "1"]
    argv += ["--device", "cpu", "--output_path", str(tmp_path), "--log_samples"]
    assert hfkv_main(argv) == 0
    (path,) = tmp_path.rglob("results_*.json")
    res = json.loads(path.read_text())
    stats = res["config"]["hfkv"]
    assert stats["method"] == "hfkv@64:mid=None" and stats["config"]["mid"] is None
    assert stats["per_task"]["niah_single_1"]["requests"] == 2
    assert 0 < stats["per_task"]["niah_single_1"]["memory_ratio"] < 1  # ~350-token prompts at 64 tokens per head
    (samples,) = tmp_path.rglob("samples_niah_single_1_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(rows) == 2 and all(r["doc"]["max_length"] == LENGTH for r in rows)
    assert all(r[str(LENGTH)] in (0.0, 1.0) for r in rows)  # RULER's own per-example score


def _lm_eval_samples(examples, **model_args) -> tuple[dict, list[dict]]:
    """lm-eval's hfkv model on the testbed over niah_single_1's first 2 documents: its results and, in the order of
    ``examples``, its samples of the same generated documents."""
    from lm_eval import simple_evaluate

    from hfkv.evaluation.ruler import tokenizer_path

    ref = simple_evaluate(
        model="hfkv",
        model_args={"pretrained": "testbed", **model_args},
        tasks=["niah_single_1"],
        limit=2,
        batch_size=1,
        device="cpu",
        log_samples=True,
        metadata={"max_seq_lengths": [LENGTH], "tokenizer": tokenizer_path("testbed")},
    )
    by_input = {s["doc"]["input"]: s for s in ref["samples"]["niah_single_1"]}
    return ref, [by_input[ex.instance.doc["input"]] for ex in examples]


@pytest.mark.slow
def test_shared_prefill_runner_scores_like_lm_eval(tmp_path):
    """The sweep's runner (one prompt forward, each cache filled from it) gives lm-eval's generations and scores."""

    from hfkv.evaluation.methods import parse_method
    from hfkv.evaluation.ruler import SharedPrefillLM, load_examples, tokenizer_path
    from hfkv.loading import load_model

    examples = load_examples("niah_single_1", LENGTH, tokenizer_path("testbed"), 2)
    model, tok = load_model("testbed")
    lm = SharedPrefillLM(model, tok, stop_when_found=False, add_bos_token=True)
    for spec in ("dynamic", "evict@64:window=16", "hfkv@64"):
        got = [lm.generate_one(ex, parse_method(spec)) for ex in examples]
        _, samples = _lm_eval_samples(examples, hfkv_config=spec)
        assert [g["output"] for g in got] == [s["resps"][0][0] for s in samples], spec
        assert [g["score"] for g in got] == [s[str(LENGTH)] for s in samples], spec
        assert all(0 < g["kv_bytes"] <= g["dense_bytes"] * 1.1 for g in got)


def test_tokenizer_path_of_model_aliases():
    from hfkv.evaluation.ruler import tokenizer_path
    from hfkv.testbed import TESTBED_PATH

    assert tokenizer_path("testbed") == str(TESTBED_PATH)
    assert tokenizer_path("some/hub-id") == "some/hub-id"


def test_unknown_ruler_task_is_refused():
    from hfkv.evaluation.ruler import load_examples

    with pytest.raises(ValueError, match="not one of RULER's offline tasks"):
        load_examples("niah_single_2", 4096, "testbed", 1)


@pytest.mark.slow
def test_question_agnostic_runner_generates_as_lm_eval_does(tmp_path):
    """--question-agnostic in the sweep's runner (one context capture shared by every cache, then the question read
    through each) gives what lm-eval's hfkv model with question_agnostic=true generates (hfkv.compress)."""

    from hfkv.evaluation.methods import parse_method
    from hfkv.evaluation.ruler import SharedPrefillLM, load_examples, tokenizer_path
    from hfkv.loading import load_model

    examples = load_examples("niah_single_1", LENGTH, tokenizer_path("testbed"), 2)
    model, tok = load_model("testbed")
    lm = SharedPrefillLM(model, tok, stop_when_found=False, add_bos_token=True, question_agnostic=True)
    for spec, scores in (("dynamic", "observation"), ("hfkv@64", "key_norm"), ("hfkv@64", "reconstruction")):
        lm.context_scores = scores
        got = [lm.generate_one(ex, parse_method(spec)) for ex in examples]
        ref, samples = _lm_eval_samples(examples, hfkv_config=spec, question_agnostic=True, context_scores=scores)
        assert [g["output"] for g in got] == [s["resps"][0][0] for s in samples], (spec, scores)
        assert ref["config"]["hfkv"]["context_scores"] == scores
