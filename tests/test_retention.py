"""Learned retention (``score_source="retention"``): the gates, their decay, the policy's use of them on every backend,
gates files, and ``hfkv train-gates`` (training, resume)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

import hfkv
from hfkv.calibration import gates_train
from hfkv.gates import Gates, initial_gates, load_gates, shipped_gates
from hfkv.policy.retention import GateWeights, gate_features, gate_values, retention_scores
from hfkv.states import EVICTED, WINDOW
from tests.models import tiny_model

LAYERS, HEADS, DIM = 2, 2, 32  # tests.models' tiny llama


def _gates(kind: str = "retention", seed: int = 0, spread: float = 0.5) -> Gates:
    """Gates for the tiny llama that tell its tokens apart (random first layer, a wide second)."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for w in initial_gates(LAYERS, HEADS, DIM, hidden=8, seed=seed):
        w2 = torch.randn(w.w2.shape, generator=g) * spread
        b2 = torch.full_like(w.b2, 5.0 if kind == "retention" else 0.0)
        layers.append(GateWeights(w.w1, torch.randn(w.b1.shape, generator=g), w2, b2))
    return Gates(layers, {"name": "tiny llama", "layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM}, {}, kind)


@pytest.fixture
def gates_file(tmp_path):
    def make(kind: str = "retention", **kw) -> str:
        path = tmp_path / f"{kind}.safetensors"
        _gates(kind, **kw).save(path)
        return str(path)

    return make


def _ids(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ the gate and its decay
def test_gate_values_match_a_loop_over_heads_and_tokens():
    gates = _gates().layers[0]
    k, v = torch.randn(2, HEADS, 5, DIM), torch.randn(2, HEADS, 5, DIM)
    got = gate_values(k, v, gates)
    for b in range(2):
        for h in range(HEADS):
            for t in range(5):
                kk, vv = k[b, h, t], v[b, h, t]
                pair = torch.stack([kk[: DIM // 2], kk[DIM // 2 :]]).norm(dim=0)
                x = torch.cat([pair, vv])
                hidden = torch.relu(x @ gates.w1[h] + gates.b1[h])
                logit = hidden @ gates.w2[h] + gates.b2[h]
                assert got[b, h, t].item() == pytest.approx(F.logsigmoid(logit).item(), rel=1e-5, abs=1e-6)
    assert (got <= 0).all()
    surrogate = gate_values(k, v, gates, "surrogate")
    assert torch.allclose(F.logsigmoid(surrogate), got, atol=1e-6)


def test_features_do_not_depend_on_the_position():
    """RoPE turns each pair (i, i + D/2) of a key: the pair norms the gate reads stay."""
    k, v = torch.randn(1, 1, 1, DIM), torch.randn(1, 1, 1, DIM)
    angle = torch.rand(DIM // 2) * 6.28
    c, s = torch.cos(angle), torch.sin(angle)
    a, b = k[..., : DIM // 2], k[..., DIM // 2 :]
    turned = torch.cat([a * c - b * s, b * c + a * s], -1)
    assert torch.allclose(gate_features(turned, v), gate_features(k, v), atol=1e-5)


def test_retention_decays_with_age_and_ranks_by_beta_to_the_age():
    beta = torch.tensor([0.999, 0.9, 0.99, 0.5])
    pos = torch.tensor([0, 97, 50, 99])
    valid = torch.tensor([True, True, True, False])
    got = retention_scores(beta.log().view(1, 1, 4), pos.view(1, 1, 4), valid.view(1, 1, 4), length=100)[0, 0]
    want = beta ** (99 - pos).float() * valid
    assert torch.allclose(got, want / want.sum(), atol=1e-6)
    later = retention_scores(beta.log().view(1, 1, 4), pos.view(1, 1, 4), valid.view(1, 1, 4), length=400)[0, 0]
    # 300 steps later the slow-decaying older token outranks the younger, faster-decaying one
    assert got[1] > got[2] and later[1] < later[2]
    assert later[0] > later[2] > later[1] and later[3] == 0
    # head_adaptive: one normalisation over the layer's heads, so the heads keep their proportions
    two = torch.stack([beta.log(), beta.log() - 0.01]).view(1, 2, 4)
    across = retention_scores(two, pos.expand(1, 2, 4), valid.expand(1, 2, 4), 100, across_heads=True)
    raw = torch.where(valid.expand(1, 2, 4), (two * (99 - pos)).exp(), 0)
    assert torch.allclose(across, raw / raw.sum() * 2, atol=1e-6)
    static = retention_scores(two, pos.expand(1, 2, 4), valid.expand(1, 2, 4), 100, kind="surrogate")
    assert torch.allclose(static, torch.softmax(two.masked_fill(~valid, -math.inf), -1), atol=1e-6)


# ------------------------------------------------------------------ the policy ranks by it, on every backend
def _captured_values(model, ids, gates: Gates) -> list[torch.Tensor]:
    """Each layer's gate values of the prompt, from DynamicCache's keys and values (an independent capture)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
    return [
        gate_values(cache.layers[i].keys, cache.layers[i].values, gates.layers[i], gates.kind) for i in range(LAYERS)
    ]


@pytest.mark.parametrize("kind", ["retention", "surrogate"])
@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_a_token_budget_keeps_the_highest_retention_of_the_prompt(kind, backend, gates_file):
    """A prompt past a token budget keeps, per head, the window and the highest-retention tokens before it: the
    brute-force top-k of ``beta ** age`` (or of the surrogate's value) on an independent capture."""
    model, ids, path = tiny_model("llama"), _ids(80), gates_file(kind)
    budget, window = 24, 4
    cache = hfkv.TriStateCache(model, "evict", budget=budget, window=window, slack=1.0, score_source="retention",
                               gates=path, backend=backend)  # fmt: skip
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
    values = _captured_values(model, ids, _gates(kind))
    t = ids.shape[1]
    for i in range(LAYERS):
        states = cache.token_states(i)[0]  # [H, T]
        older = values[i][0, :, : t - window]
        rank = older * (t - 1 - torch.arange(t - window)) if kind == "retention" else older
        for h in range(HEADS):
            kept = states[h, : t - window] != EVICTED
            assert int(kept.sum()) == budget - window, (i, h)
            # the kept ones rank at least as high as any dropped one (ties may go either way)
            assert rank[h][kept].min() >= rank[h][~kept].max() - 1e-6, (i, h)
            assert (states[h, t - window :] == WINDOW).all()


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_every_backend_decodes_as_the_torch_twin(backend, gates_file):
    """Greedy decoding past a memory budget: the same tokens, states and fields as the torch backend (Triton on its
    interpreter), head-adaptive or not; the fields stay the gates' values (no attention is added to them)."""
    model, ids, path = tiny_model("llama"), _ids(60, 1, batch=2), gates_file("retention")
    steps = 6 if backend == "triton" else 24
    for extra in ({}, {"head_adaptive": True}):
        out, caches = {}, {}
        for b in ("torch", backend):
            caches[b] = hfkv.TriStateCache(model, "hfkv", budget=28, window=4, interval=4, score_source="retention",
                                           gates=path, backend=b, **extra)  # fmt: skip
            out[b] = model.generate(ids, past_key_values=caches[b], max_new_tokens=steps, do_sample=False)
        assert torch.equal(out["torch"], out[backend])
        for i in range(LAYERS):
            assert torch.equal(caches["torch"].token_states(i), caches[backend].token_states(i))
            a, b = caches["torch"].token_scores(i), caches[backend].token_scores(i)
            assert torch.allclose(a.nan_to_num(-1), b.nan_to_num(-1), atol=1e-6)
    layer = caches["torch"].layers[0]
    seq = out["torch"][:, :-1]  # the last token was sampled, never fed back
    want = _captured_values(model, seq, _gates())[0]
    held = layer.window.pos >= 0
    assert torch.allclose(layer.window.score[:, :, held], want[:, :, layer.window.pos[held]], atol=1e-5)


def test_within_its_budget_retention_is_dynamic_cache_token_for_token(gates_file):
    model, ids = tiny_model("llama"), _ids(40, 2, batch=2)
    cache = hfkv.TriStateCache(model, "hfkv", budget=512, score_source="retention", gates=gates_file())
    want = model.generate(ids, past_key_values=DynamicCache(), max_new_tokens=20, do_sample=False)
    assert torch.equal(model.generate(ids, past_key_values=cache, max_new_tokens=20, do_sample=False), want)


def test_leaving_the_dense_phase_ranks_by_retention(gates_file):
    """A sequence that outgrows the budget while decoding leaves the dense phase ranked by the gates' values: with
    static (surrogate) values and no slack, what its first layer holds in the end is what one prompt of that length
    keeps."""
    model, path = tiny_model("llama"), gates_file("surrogate")
    kw = dict(budget=24, window=4, slack=1.0, score_source="retention", gates=path)
    ids = _ids(20, 3)
    grown = hfkv.TriStateCache(model, "evict", **kw)
    seq = model.generate(ids, past_key_values=grown, max_new_tokens=12, do_sample=False)
    whole = hfkv.TriStateCache(model, "evict", **kw)
    with torch.no_grad():
        model(input_ids=seq[:, :-1], past_key_values=whole)
    # layer 0 only: a later layer's keys depend on what the layers below held, which the two runs do not share
    assert torch.equal(grown.token_states(0), whole.token_states(0))
    assert (grown.token_states(0) == EVICTED).sum() == (seq.shape[1] - 1 - 24) * HEADS


def test_a_fork_and_a_saved_cache_keep_the_values(gates_file, tmp_path):
    model, ids, q = tiny_model("llama"), _ids(70, 4), _ids(6, 5)
    cache = hfkv.compress(model, ids, "hfkv", budget=24, window=4, score_source="retention", gates=gates_file())
    loaded = hfkv.TriStateCache.load(cache.save(tmp_path / "c.safetensors"), model)
    with torch.no_grad():
        want = model(input_ids=q, past_key_values=cache.fork()).logits
        assert torch.equal(model(input_ids=q, past_key_values=loaded).logits, want)
    with pytest.raises(ValueError, match="ranks by its gates: pass no scores"):
        hfkv.compress(model, ids, "hfkv", scores="reconstruction", score_source="retention", gates=gates_file())


# ------------------------------------------------------------------ gates files and config
def test_gates_for_another_model_fail_with_one_error_naming_both(gates_file):
    path = gates_file()
    other = tiny_model("llama", num_hidden_layers=3)
    with pytest.raises(
        ValueError, match=r"trained for 'tiny llama' \(2 layers, 2 KV heads, head dim 32\) and are used"
    ):
        hfkv.TriStateCache(other, "hfkv", score_source="retention", gates=path)
    wide = tiny_model("llama", num_key_value_heads=4)
    with pytest.raises(ValueError, match="trained for 'tiny llama'"):
        hfkv.TriStateCache(wide, "hfkv", score_source="retention", gates=path)
    layerless = hfkv.TriStateCache(None, "hfkv", score_source="retention", gates=path)  # checked at the first keys
    with pytest.raises(ValueError, match="trained for 'tiny llama'"), torch.no_grad():
        wide(input_ids=_ids(8), past_key_values=layerless)


def test_config_names_what_retention_needs():
    with pytest.raises(
        ValueError, match=r"TriStateConfig.gates=None must be a gates file where score_source='retention'"
    ):
        hfkv.TriStateConfig(score_source="retention")
    with pytest.raises(
        ValueError, match=r"TriStateConfig.gates='smolm2' must be one of the shipped gates .* 'smollm2'"
    ):
        hfkv.TriStateConfig(score_source="retention", gates="smolm2")
    with pytest.raises(ValueError, match=r"TriStateConfig.gates='testbed' must be None where score_source='attention'"):
        hfkv.TriStateConfig(gates="testbed")
    with pytest.raises(ValueError, match=r"TriStateConfig.score_source='learned' must be one of"):
        hfkv.TriStateConfig(score_source="learned")
    cfg = hfkv.TriStateConfig.from_preset("hfkv", score_source="retention", gates="testbed")
    assert hfkv.TriStateConfig.from_dict(cfg.to_dict()) == cfg


def test_shipped_gates_load_offline_and_fit_their_models():
    from hfkv.testbed import load_testbed

    assert set(shipped_gates()) >= {"smollm2", "testbed"}
    smol = load_gates("smollm2")
    assert (smol.model["layers"], smol.model["kv_heads"], smol.model["head_dim"]) == (30, 3, 64)
    assert smol.training["settings"]["data"] == "stdlib" and smol.training["seconds"] > 0
    model, tok = load_testbed()
    ids = tok("- apple 1234\n- pear 5678\n" * 30 + "? apple", return_tensors="pt").input_ids
    cache = hfkv.TriStateCache(model, "hfkv", budget=48, score_source="retention", gates="testbed")
    model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
    assert cache.layers[0].retention.kind == load_gates("testbed").kind
    with pytest.raises(ValueError, match="trained for 'smollm2'"):
        hfkv.TriStateCache(model, "hfkv", score_source="retention", gates="smollm2")


# ------------------------------------------------------------------ training
def _settings(**kw) -> gates_train.Settings:
    base = dict(model="testbed", kind="retention", data="testbed", seq_len=128, rows=16, steps=6, chunk_steps=2,
                capacity=16, capacity_weight=1.0, hidden=4, lr=1e-2, seed=0)  # fmt: skip
    return gates_train.Settings(**{**base, **kw})


@pytest.mark.parametrize("kind", ["retention", "surrogate"])
def test_an_interrupted_training_resumes_to_the_same_gates(kind, tmp_path, monkeypatch):
    from hfkv.testbed import load_testbed

    model, tok = load_testbed()
    model.requires_grad_(False)
    settings = _settings(kind=kind)
    whole = load_gates(str(gates_train.train(model, tok, settings, tmp_path / "whole.safetensors", 2, log=str)))
    out = tmp_path / "cut.safetensors"
    real_step, calls = gates_train.Trainer.step, []

    def step(self, *a):
        if len(calls) == 3:  # the fourth step: after the checkpoint of step 2, before that of step 4
            raise KeyboardInterrupt
        calls.append(1)
        return real_step(self, *a)

    monkeypatch.setattr(gates_train.Trainer, "step", step)
    with pytest.raises(KeyboardInterrupt):
        gates_train.train(model, tok, settings, out, 2, log=str)
    assert gates_train.checkpoint_path(out).exists() and not out.exists()
    monkeypatch.setattr(gates_train.Trainer, "step", real_step)
    with pytest.raises(ValueError, match="a checkpoint of other settings"):
        gates_train.train(model, tok, _settings(kind=kind, hidden=8), out, 2, log=str)
    lines = []
    resumed = load_gates(str(gates_train.train(model, tok, settings, out, 2, log=lines.append)))
    assert lines[0].startswith("resuming at step 2 of 6")
    assert not gates_train.checkpoint_path(out).exists()
    for a, b in zip(whole.layers, resumed.layers, strict=True):
        assert all(torch.equal(getattr(a, p), getattr(b, p)) for p in ("w1", "b1", "w2", "b2"))
    assert resumed.kind == kind and resumed.training["settings"]["steps"] == 6
    assert resumed.training["data"]["sha256"] == gates_train.testbed_text()[1]


def test_training_lowers_its_loss_and_keeps_the_capacity():
    """Distillation with the capacity term: the retention a query sees ends under (or near) M, where untrained gates
    keep every token; the gates' output is what the trainer's own forward gives on the same features."""
    from hfkv.testbed import load_testbed

    model, tok = load_testbed()
    model.requires_grad_(False)
    settings = _settings(steps=1)
    data, _ = gates_train.chunks(tok, "testbed", 256)
    captured = gates_train.capture(model, data[0])
    trainer = gates_train.Trainer(4, 2, 32, settings)
    gen = torch.Generator().manual_seed(0)
    first = trainer.step(captured, gen)
    for _ in range(60):
        last = trainer.step(captured, gen)
    assert last["over_capacity"] < 0.25 * first["over_capacity"]
    q, k, v, _ = captured[1]
    folded = trainer.gate_weights()[1]
    with torch.no_grad():
        want = trainer.values(1, gate_features(k, v))
    assert torch.allclose(gate_values(k[None], v[None], folded)[0], want, atol=1e-4)
