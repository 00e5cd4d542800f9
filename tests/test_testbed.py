"""The testbed: task generators, scorers, shipped test sets, tokenizer, shipped model, lm-eval YAMLs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hfkv.testbed import tasks as T  # noqa: E402
from hfkv.testbed.tasks import TASKS, TEST_SEEDS, TEST_SIZE, arith_cot_extract, kv_recall_extract  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASK_DIR = ROOT / "eval" / "tasks"


# ---------------------------------------------------------------- generators and scorers


@pytest.mark.parametrize("name", sorted(TASKS))
def test_generators_deterministic_by_seed(name):
    task = TASKS[name]
    a = task.generate(5, seed=3)
    assert a == task.generate(5, seed=3)
    assert a != task.generate(5, seed=4)
    assert a[:3] == task.generate(3, seed=3)
    for ex in a:
        assert set(ex) == {"prompt", "target"}
        assert ex["prompt"] and ex["target"]
        assert task.stop not in ex["target"]


def test_generators_do_not_touch_global_random():
    import random

    random.seed(123)
    expected = random.random()
    random.seed(123)
    for task in TASKS.values():
        task.generate(3, seed=0)
    assert random.random() == expected


def test_kv_recall_structure():
    rows = TASKS["kv_recall"].generate(20, seed=7, length=(800, 1400), n_questions=4)
    for r in rows:
        prompt, target = r["prompt"], r["target"]
        assert 750 <= len(prompt) <= 1500
        assert prompt.endswith(": ") and prompt.rsplit("\n", 1)[1].startswith("? ")
        key = prompt.rsplit("\n", 1)[1][2:-2]
        lines = prompt.split("\n")
        recs = [ln for ln in lines if ln.startswith(f"{key}: ")]
        assert recs == [f"{key}: {target}"]  # exactly one record holds the answer
        assert prompt.count(key) == 2  # the record and the final question, asked nowhere else
        # the record lies in the first third of the context
        assert prompt.index(f"{key}: ") < len(prompt) / 3 + 20
        assert target.isdigit() and 4 <= len(target) <= 6
        assert sum(ln.startswith("? ") for ln in lines) == 4


def test_kv_recall_length_knob():
    short = TASKS["kv_recall"].generate(10, seed=1, length=200)
    long = TASKS["kv_recall"].generate(3, seed=1, length=2000)
    assert max(len(r["prompt"]) for r in short) < 320
    assert all(len(r["prompt"]) >= 1900 for r in long)


def test_arith_cot_structure_and_values():
    rows = TASKS["arith_cot"].generate(30, seed=5)
    for r in rows:
        env = {}
        for line in r["prompt"].split("\n"):
            if "=" in line:
                name, expr = line.split("=")
                env[name] = int(expr) if expr.isdigit() else eval(expr, {}, dict(env))  # noqa: S307
        cot, ans = r["target"].split(" #### ")
        steps = cot.split("; ")
        last = steps[-1].split("=")[0]
        assert r["prompt"].endswith(f"? {last}\n")
        assert int(ans) == env[last]
        for s in steps:
            head, num, res = s.split(" = ")
            v = head.split("=")[0]
            assert eval(num) == int(res) == env[v]  # noqa: S307
            assert 0 <= int(res) <= 99


def test_scorers_accept_target_reject_perturbations():
    kv = TASKS["kv_recall"]
    assert kv.score("48213", "48213")
    assert kv.score("48213\n? abcd: 1", "48213")
    assert not kv.score("48214", "48213")
    assert not kv.score("4821", "48213")
    assert not kv.score("482130", "48213")
    assert not kv.score("", "48213")
    assert kv_recall_extract(" 0042x") == "0042"
    ar = TASKS["arith_cot"]
    t = "a=k+5 = 12+5 = 17; b=a-q = 17-7 = 10 #### 10"
    assert ar.score(t, t)
    assert ar.score("a = 1+9 = 10 #### 10", t)  # only the final answer counts
    assert not ar.score("a=k+5 = 12+5 = 17; b=a-q = 17-7 = 10 #### 11", t)
    assert not ar.score("a=k+5 = 12+5 = 17; b=a-q = 17-7 = 10", t)
    assert not ar.score("#### 100", t)
    assert arith_cot_extract("x #### 7 #### 8") == "7"
    for name, task in TASKS.items():
        for r in task.generate(10, seed=11):
            assert task.score(r["target"], r["target"]), name


# ---------------------------------------------------------------- shipped test sets and YAMLs


@pytest.mark.parametrize("name", sorted(TASKS))
def test_shipped_jsonl_matches_generator(name):
    path = Path(T.test_set_path(name))
    assert path == TASK_DIR / f"testbed_{name}.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(rows) == TEST_SIZE
    assert rows == T.test_set(name)
    manifest = json.loads((TASK_DIR / "testbed_manifest.json").read_text())
    assert manifest[name]["seed"] == TEST_SEEDS[name]
    assert manifest[name]["n"] == TEST_SIZE


@pytest.mark.parametrize("name", sorted(TASKS))
def test_lm_eval_yaml(name):
    import yaml

    cfg = yaml.safe_load((TASK_DIR / f"testbed_{name}.yaml").read_text())
    assert cfg["task"] == f"testbed_{name}"
    assert cfg["output_type"] == "generate_until"
    assert cfg["dataset_path"] == "json"
    data = ROOT / cfg["dataset_kwargs"]["data_files"]["test"]
    assert data.exists()
    assert cfg["generation_kwargs"]["until"] == [TASKS[name].stop]
    assert cfg["generation_kwargs"]["max_gen_toks"] >= TASKS[name].max_new_tokens
    assert cfg["metric_list"][0]["metric"] == "exact_match"
    # the YAML's regex filter extracts the same answer as the task's scorer
    import re

    pattern = re.compile(cfg["filter_list"][0]["filter"][0]["regex_pattern"])
    for row in T.test_set(name, 20):
        assert pattern.findall(row["target"])[0] == row["answer"] == TASKS[name].extract(row["target"])


# ---------------------------------------------------------------- tokenizer


ROUND_TRIP = [
    "hello world",
    "  two  spaces \n\nand newlines\n",
    "kqzt: 48213\n? kqzt 48213\n",
    "a=k+5 = 12+5 = 17; #### 17",
    "punct: !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    " ",
    "\n",
]


def test_tokenizer_round_trip(tmp_path):
    from transformers import AutoTokenizer

    from hfkv.testbed.tokenizer import save_tokenizer

    path = tmp_path / "tok"
    save_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    assert tok.padding_side == "left"
    assert len(tok) == 100
    for s in ROUND_TRIP:
        ids = tok(s)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert len(ids) == len(s) + 1  # one token per character
        assert tok.decode(ids, skip_special_tokens=True) == s
        assert tok.decode(ids[1:]) == s
    batch = tok(["ab", "abcd"], padding=True)
    assert batch["input_ids"][0][:2] == [tok.pad_token_id] * 2
    assert batch["attention_mask"][0] == [0, 0, 1, 1, 1]


# ----------------------------------------------------------------- training
# No trained testbed is shipped yet (the CPU budget of the first attempt ran out before the model
# learned content-based lookup; see eval/testbed/NOTES.md). What is shipped is the recipe: this
# test runs it end to end at toy size and loads the result offline the way the demo will.


@pytest.fixture(scope="module")
def toy_model_dir(tmp_path_factory):
    from hfkv.testbed import train

    out = tmp_path_factory.mktemp("testbed") / "model"
    rc = train.main(
        ["--out", str(out), "--steps", "3", "--tokens", "256", "--max-len", "300", "--layers", "1",
         "--hidden", "64", "--intermediate", "128", "--heads", "2", "--kv-heads", "1", "--threads", "1",
         "--eval-every", "1000", "--eval-n", "1", "--warmup", "1", "--log", str(out.parent / "train.log")]
    )  # fmt: skip
    assert rc in (0, None)
    return out


def test_training_script_saves_a_model_that_loads_offline_and_generates(toy_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(toy_model_dir)
    tok = AutoTokenizer.from_pretrained(toy_model_dir)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    row = json.loads(Path(T.test_set_path("kv_recall")).read_text().splitlines()[0])
    enc = tok(row["prompt"][:200], return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(**enc, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert gen.shape[1] == enc["input_ids"].shape[1] + 5
    assert isinstance(tok.decode(gen[0], skip_special_tokens=True), str)


def test_demo_runs_presets_on_a_testbed_model(toy_model_dir, capsys):
    """The demo's preset rows go through TriStateCache inside generate (a toy model: no accuracy claim)."""
    import argparse

    from hfkv.testbed import demo

    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    args = p.parse_args(["--model", str(toy_model_dir), "--limit", "1", "--presets", "evict,hfkv", "--budgets", "96",
                         "--no-progress"])  # fmt: skip
    assert demo.run(args) == 0
    out = capsys.readouterr().out
    for task in TASKS:
        for cache in ("DynamicCache", "evict@96", "hfkv@96"):
            assert any(line.startswith(task) and cache in line for line in out.splitlines()), (task, cache, out)
