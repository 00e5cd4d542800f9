"""Objectives on a tiny random model: fidelity is exact for `full` and worse under compression; accuracy
scores the last \\boxed{} of what the model generates; head statistics and prompts."""

from __future__ import annotations

import math

import pytest
import torch

from hfkv.calibration.data import load_jsonl
from hfkv.calibration.granularity import alpha_tables, head_statistics
from hfkv.calibration.objectives import AccuracyObjective, FidelityObjective, encode, prompt_text
from hfkv.calibration.search import least_valid_budget
from hfkv.config import TriStateConfig
from hfkv.loading import load_model
from tests.calibration_support import FIXTURE, save_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny(tmp_path_factory.mktemp("tiny") / "model", chat=True)
    return load_model(str(path))


@pytest.fixture(scope="module")
def problems():
    return load_jsonl(FIXTURE)[:3]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small models: one thread is faster than two on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_fidelity_is_exact_for_full_and_worse_for_a_tiny_budget(tiny, problems):
    model, tok = tiny
    obj = FidelityObjective(model, tok, problems[:2], chunk=1, max_solution_tokens=16)
    full = obj.evaluate(TriStateConfig.from_preset("full"))
    assert full.quality == {"kl": 0.0, "top1": 1.0} and full.memory_ratio == 1.0 and full.n == 2
    least = least_valid_budget(lambda b: TriStateConfig.from_preset("evict", budget=b, window=4))
    small = obj.evaluate(TriStateConfig.from_preset("evict", budget=least, window=4))
    assert small.quality["kl"] > 1e-4 and small.quality["top1"] < 1.0
    assert small.memory_ratio < 0.5
    assert small.kv_bytes < full.kv_bytes and small.dense_bytes == full.dense_bytes


def test_chunked_fidelity_is_still_exact_for_full(tiny, problems):
    model, tok = tiny
    obj = FidelityObjective(model, tok, problems[:2], chunk=5, max_solution_tokens=24)
    assert obj.evaluate(TriStateConfig.from_preset("full")).quality == {"kl": 0.0, "top1": 1.0}


def test_encoding_is_prompt_then_solution(tiny, problems):
    _, tok = tiny
    (it,) = encode(tok, problems[:1], "chat", 0, 10)
    prompt = prompt_text(tok, problems[0].problem, "chat")
    assert prompt.startswith("<|user|>") and prompt.endswith("<|assistant|>") and "\\boxed{}" in prompt
    assert it.ids.shape == (1, it.prompt_len + 10)
    assert tok.decode(it.ids[0, it.prompt_len :]) == tok.decode(tok(problems[0].solution).input_ids[:10])
    plain = prompt_text(tok, "What is 1+1?", "plain", n_shots=2)
    assert plain.count("Problem:") == 3 and plain.endswith("Problem:\nWhat is 1+1?\n\nSolution:\n")
    with pytest.raises(ValueError, match="--n-shots"):
        prompt_text(tok, "x", "plain", n_shots=9)


def test_accuracy_scores_the_last_box_of_the_generation(tiny, problems, monkeypatch):
    model, tok = tiny
    obj = AccuracyObjective(model, tok, problems, max_new_tokens=12, batch_size=2)
    ev = obj.evaluate(TriStateConfig.from_preset("full"))  # a random model: real generate, no box
    assert ev.quality["accuracy"] == 0.0 and ev.memory_ratio == 1.0 and len(obj.last_outputs) == 3
    # The scoring path on known outputs: the reference solutions (right) and one wrong final answer.
    answers = [p.solution for p in problems]
    answers[1] = answers[1].replace("\\boxed{", "\\boxed{1000+")
    real_generate = model.generate

    def generate(input_ids, **kw):
        out = real_generate(input_ids=input_ids, **kw)  # keep the cache and memory path real
        texts = [answers[obj.prompts.index(p)] for p in tok.batch_decode(input_ids, skip_special_tokens=True)]
        tail = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt").input_ids
        return torch.cat([input_ids, tail], 1) if out is not None else out

    monkeypatch.setattr(model, "generate", generate)
    ev = obj.evaluate(TriStateConfig.from_preset("diffkv"))
    assert ev.quality["accuracy"] == pytest.approx(2 / 3)
    assert 0 < ev.memory_ratio < 1


def test_head_statistics_give_valid_tables(tiny, problems):
    model, tok = tiny
    items = encode(tok, problems[:2], "chat", 0, 16)
    stats = head_statistics(model, items, TriStateConfig.from_preset("diffkv"))
    table = stats["median_log_score"]
    assert len(table) == model.config.num_hidden_layers and all(len(r) == 2 for r in table)
    assert all(math.isfinite(x) for r in table for x in r) and stats["tokens"] > 0
    h, lo = alpha_tables("head", 1.0, 0.05, stats, beta_h=1.0, beta_l=1.0, delta=0.5)
    cfg = TriStateConfig.from_preset("diffkv", alpha_h=h, alpha_l=lo)
    obj = FidelityObjective(model, tok, problems[:1], max_solution_tokens=8)
    assert obj.evaluate(cfg).n == 1
