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
    from hfkv.testbed.tokenizer import count_tokens

    rows = TASKS["kv_recall"].generate(20, seed=7, length=(400, 640), n_questions=4)
    for r in rows:
        prompt, target = r["prompt"], r["target"]
        assert 380 <= count_tokens(prompt) <= 660
        last = prompt.rsplit("\n", 1)[1]
        assert last.startswith("? ") and last.count(" ") == 1
        key = last[2:]
        lines = prompt.split("\n")
        recs = [ln for ln in lines if ln.startswith(f"- {key} ")]
        assert recs == [f"- {key}{target}"]  # exactly one record holds the answer
        assert prompt.count(f" {key}") == 2  # the record and the final question, asked nowhere else
        # the record lies in the first third of the records
        records = [ln for ln in lines if ln.startswith("- ")]
        assert records.index(recs[0]) < len(records) / 3
        assert target[0] == " " and target[1:].isdigit() and len(target) == 5
        assert sum(ln.startswith("? ") for ln in lines) == 4


def test_kv_recall_length_knob():
    from hfkv.testbed.tokenizer import count_tokens

    short = TASKS["kv_recall"].generate(10, seed=1, length=120)
    long = TASKS["kv_recall"].generate(3, seed=1, length=2500)
    assert max(count_tokens(r["prompt"]) for r in short) < 150
    assert all(count_tokens(r["prompt"]) >= 2400 for r in long)


def test_arith_cot_structure_and_values():
    rows = TASKS["arith_cot"].generate(30, seed=5, consts=(3, 5))  # named constants: recalled
    for r in rows:
        env, consts = {}, set()
        for line in r["prompt"].split("\n"):
            if line.startswith("let "):
                name, expr = line[4:].split(" = ")
                env[name] = int(expr) if expr.isdigit() else eval(expr, {}, dict(env))  # noqa: S307
                if expr.isdigit():
                    consts.add(name)
        assert r["target"].startswith(" a = ")
        cot, ans = r["target"][1:].split(" #### ")
        n_steps = 0
        for part in cot.split(" ; "):
            words = part.split(" ")
            if len(words) == 5:  # the step's definition, restated
                v, _, x, _, y = words
                assert f"let {part}\n" in r["prompt"]
                recalled = []
            elif len(words) == 3:  # a recalled constant
                c, _, n = words
                assert c in consts and c in (x, y) and c not in recalled and int(n) == env[c]
                recalled.append(c)
            else:  # substitution and result
                v2, _, a, op, b, _, res = words
                assert v2 == v and recalled == [c for c in dict.fromkeys((x, y)) if c in consts]
                assert eval(f"{a} {op} {b}") == int(res) == env[v]  # noqa: S307
                assert 0 <= int(res) <= 99
                n_steps += 1
        assert r["prompt"].endswith(f"? {v}\n") and int(ans) == env[v]
        assert 3 <= n_steps <= 6
    for r in TASKS["arith_cot"].generate(5, seed=5):  # the default (test sets): literals only
        lets = [ln for ln in r["prompt"].split("\n") if ln.startswith("let ")]
        assert lets[0].startswith("let a = ") and all(ln[4] in T.CHAIN_NAMES for ln in lets)
        parts = r["target"][1:].split(" #### ")[0].split(" ; ")
        assert [len(p.split(" ")) for p in parts] == [5, 7] * (len(parts) // 2)  # definition, substitution
    plain = TASKS["arith_cot"].generate(3, seed=5, consts=(3, 5), recall=False)
    assert [r["prompt"] for r in plain] == [r["prompt"] for r in rows[:3]]
    assert all(len(p["target"]) < len(r["target"]) for p, r in zip(plain, rows, strict=False))
    assert " = " in plain[0]["target"] and " ; k = " not in plain[0]["target"]


def test_scorers_accept_target_reject_perturbations():
    kv = TASKS["kv_recall"]
    assert kv.score("48213", "48213")
    assert kv.score(" 48213", " 48213")
    assert kv.score("48213\n? abcd: 1", "48213")
    assert not kv.score("48214", "48213")
    assert not kv.score("4821", "48213")
    assert not kv.score("482130", "48213")
    assert not kv.score("", "48213")
    assert kv_recall_extract(" 0042x") == "0042"
    ar = TASKS["arith_cot"]
    t = " a = k + 5 ; k = 12 ; a = 12 + 5 = 17 ; b = a - q ; q = 7 ; b = 17 - 7 = 10 #### 10"
    assert ar.score(t, t)
    assert ar.score(" a = 1 + 9 = 10 #### 10", t)  # only the final answer counts
    assert not ar.score(t.replace("#### 10", "#### 11"), t)
    assert not ar.score(t.replace(" #### 10", ""), t)
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
    "- bofe 48213\n? bofe 48213\n",
    "let a = k + 5\n a = k + 5 = 12 + 5 = 17 ; #### 17",
    "punct: !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "there theriver the river0 007 12345",
    " ",
    "\n",
]


def test_tokenizer_round_trip_and_units(tmp_path):
    from transformers import AutoTokenizer

    from hfkv.testbed.tokenizer import KEY_WORDS, count_tokens, save_tokenizer, vocab

    path = tmp_path / "tok"
    save_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    assert tok.padding_side == "left"
    assert len(tok) == len(vocab())
    for s in ROUND_TRIP:
        ids = tok(s)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert tok.unk_token_id not in ids
        assert len(ids) == count_tokens(s) + 1
        assert tok.decode(ids, skip_special_tokens=True) == s
        assert tok.decode(ids[1:]) == s
    # the units of the tasks are single tokens, the same with or without <s>
    assert tok.tokenize(f"- {KEY_WORDS[0]} 4821") == ["-", f" {KEY_WORDS[0]}", " 48", "21"]
    assert tok.tokenize("let a = 17 #### 5") == ["let", " a", " =", " 17", " ####", " 5"]
    assert tok.tokenize("there") == ["t", "h", "e", "r", "e"]  # not "the" + "re"
    batch = tok(["ab", "abcd"], padding=True)
    assert batch["input_ids"][0][:2] == [tok.pad_token_id] * 2
    assert batch["attention_mask"][0] == [0, 0, 1, 1, 1]


def test_training_encoder_matches_tokenizer():
    from hfkv.testbed.tokenizer import build_tokenizer
    from hfkv.testbed.train import encode

    tok = build_tokenizer()
    for name, task in TASKS.items():
        for r in task.generate(3, seed=2):
            text = r["prompt"] + r["target"]
            assert encode(text) == tok(text)["input_ids"][1:], name
            # prompt and target tokenize independently (no token straddles the boundary)
            assert encode(r["prompt"]) + encode(r["target"]) == encode(text), name


# ----------------------------------------------------------------- training
# The training recipe end to end at toy size (the shipped model's accuracy is tested below).


def _induction_probe(model):
    """Attention of layer 0 to the previous token, of layer 1 to the token after the earlier copy,
    and copy accuracy, on 30 random key words repeated (the circuit kv_recall needs)."""
    import random

    import torch

    from hfkv.testbed.tokenizer import KEY_WORDS
    from hfkv.testbed.train import BOS_ID, encode

    rng = random.Random(0)
    n = 30
    words = " ".join(rng.choice(KEY_WORDS) for _ in range(n))
    ids = torch.tensor([[BOS_ID] + encode(f"- {words}\n? {words}\n")])
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    first = torch.arange(2, 2 + n)  # positions of the first copy
    second = first + n + 2
    t = torch.arange(1, ids.shape[1])
    prev = out.attentions[0][0, :, t, t - 1].mean(-1)  # per head of layer 0
    ind = out.attentions[1][0, :, second[:-1], first[1:]].mean(-1)  # per head of layer 1
    copy = (out.logits[0, second[:-1]].argmax(-1) == ids[0, second[1:]]).float().mean()
    return prev, ind, copy.item()


def test_induction_circuit_init_works_before_training():
    import argparse

    import torch
    from transformers import LlamaForCausalLM

    from hfkv.testbed import train

    args = argparse.Namespace(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, rope_theta=1e7)
    torch.manual_seed(0)
    plain = LlamaForCausalLM._from_config(train.make_config(args), attn_implementation="eager")
    prev, ind, copy = _induction_probe(plain)
    assert prev.max() < 0.2 and ind.max() < 0.2 and copy < 0.05  # a random init has no circuit
    train.init_induction_circuit(plain)
    prev, ind, copy = _induction_probe(plain)
    assert prev[0] > 0.99 and ind[0] > 0.5 and copy > 0.3
    emb = plain.model.embed_tokens.weight[train.PAD_ID + 1 :]  # <pad> (id 0) stays a zero vector
    assert train.PAD_ID == 0
    assert torch.allclose(emb[:, 1:].norm(dim=1), torch.full((emb.shape[0],), train.EMBED_RADIUS))
    assert (emb[:, 0] == train.CONSTANT_CHANNEL).all()
    with pytest.raises(ValueError, match="num_hidden_layers=1"):
        args.layers = 1
        train.init_induction_circuit(LlamaForCausalLM._from_config(train.make_config(args)))


@pytest.fixture(scope="module")
def toy_model_dir(tmp_path_factory):
    from hfkv.testbed import train

    out = tmp_path_factory.mktemp("testbed") / "model"
    rc = train.main(
        ["--out", str(out), "--steps", "3", "--tokens", "256", "--max-len", "300", "--layers", "2",
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


def test_demo_runs_presets_on_a_testbed_model(toy_model_dir, capsys, tmp_path):
    """The demo's preset rows go through TriStateCache inside generate (a toy model: no accuracy claim); it
    says what it ran on, and ``--out`` keeps the printed rows with how the run went."""
    import argparse
    import json

    import torch

    from hfkv.evaluation import demo

    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    args = p.parse_args(["--model", str(toy_model_dir), "--limit", "1", "--presets", "evict,hfkv", "--budgets", "96",
                         "--no-progress", "--out", str(tmp_path / "demo.json")])  # fmt: skip
    assert demo.run(args) == 0
    out = capsys.readouterr().out
    for task in TASKS:
        for cache in ("DynamicCache", "evict@96", "hfkv@96"):
            assert any(line.startswith(task) and cache in line for line in out.splitlines()), (task, cache, out)
    threads = torch.get_num_threads()
    assert f"float32, cpu, {threads} torch threads" in out and "indicative" in out
    saved = json.loads((tmp_path / "demo.json").read_text())
    assert demo.format_table(saved["rows"], speed_note=saved["run"]["speed_note"]) in out
    assert [r["cache"] for r in saved["rows"]] == ["DynamicCache", "evict@96", "hfkv@96"] * len(TASKS)
    run = saved["run"]
    assert run["threads"] == threads and run["dtype"] == "float32" and run["wall_s"] > 0
    assert run["load_average_before"] >= 0 and run["load_average_after"] >= 0 and run["options"]["limit"] == 1


# ----------------------------------------------------------------- the shipped model


@pytest.fixture(scope="module")
def shipped():
    from hfkv.testbed import load_testbed

    return load_testbed()


def test_shipped_model_loads_offline_within_limits(shipped):
    from hfkv.testbed import TESTBED_PATH
    from hfkv.testbed.tokenizer import vocab

    model, tok = shipped
    cfg = model.config
    assert cfg.model_type == "llama"
    assert cfg.num_attention_heads >= 4 and cfg.num_key_value_heads == 2  # GQA
    assert cfg.max_position_embeddings >= 4096
    assert tok.get_vocab() == vocab()  # the shipped tokenizer is the one the code builds
    files = list(Path(TESTBED_PATH).iterdir())
    assert sum(f.stat().st_size for f in files) <= 20 * 2**20
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= {f.name for f in files}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_shipped_model_full_cache_accuracy(shipped, name):
    """The claim of the model card: >= 90% exact match on each shipped test set with a full cache."""
    from hfkv.testbed.protocol import evaluate

    model, tok = shipped
    r = evaluate(model, tok, name, T.load_test_set(name))
    assert r["n"] == TEST_SIZE
    assert r["accuracy"] >= 0.9, r


def test_small_evict_budget_costs_accuracy(shipped):
    """The testbed discriminates: keeping 48 tokens of ~520 loses the early records."""
    from hfkv.testbed.protocol import evaluate

    model, tok = shipped
    rows = T.load_test_set("kv_recall")[:50]
    full = evaluate(model, tok, "kv_recall", rows)
    small = evaluate(model, tok, "kv_recall", rows, preset="evict", budget=48)
    assert small["compression"] > 5
    assert small["accuracy"] <= full["accuracy"] - 0.3, (full, small)
