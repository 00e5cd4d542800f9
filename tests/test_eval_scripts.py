"""The figure scripts under eval/ run end to end at toy sizes and write what the notes quote."""

from __future__ import annotations

import json
import runpy
import sys

import pytest


def test_cpu_cache_figures_writes_ratios(tmp_path, monkeypatch):
    from hfkv.evaluation import quiet

    out = tmp_path / "figures.json"
    argv = [
        "cpu_cache_figures.py",
        *("--prompt", "80", "--new-tokens", "4", "--budget", "64", "--long-context", "160"),
        *("--short-context", "40", "--steps", "3", "--timed", "hfkv,evict", "--out", str(out)),
        *("--threads", "1,2"),
    ]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(quiet, "load_average", lambda: 0.05)  # a quiet machine (tests/test_quiet.py: busy)
    runpy.run_path("eval/cpu_cache_figures.py", run_name="__main__")
    result = json.loads(out.read_text())
    rows = {r["cache"]: r for r in result["memory"]}
    assert rows["dynamic"]["compression_ratio"] == 1.0
    for name in ("evict", "quant", "hfkv"):
        assert rows[name]["kv_bytes"] > 0
        assert rows[name]["compression_ratio"] == pytest.approx(rows[name]["dense_bytes"] / rows[name]["kv_bytes"])
    assert rows["quant"]["compression_ratio"] > 1.0  # everything outside the window is K4V2
    assert [s["threads"] for s in result["timings"]] == [1, 2]  # each thread count its own section
    for section in result["timings"]:
        for label, ctx in (("long", 160), ("short", 40)):
            entry = section[f"decode_{label}"]
            assert entry["context"] == ctx
            for name in ("hfkv", "evict"):
                t = entry[name]
                assert t["speedup_median"] == pytest.approx(entry["dynamic_ms_median"] / t["ms_median"])
                assert t["speedup_mean"] == pytest.approx(entry["dynamic_ms_mean"] / t["ms_mean"])
    q = result["quiet"]
    assert q["threads"] == [1, 2] and q["load_before"] == q["load_after"] == 0.05 and not q["busy"]
    assert result["busy"] is False and result["memory_threads"] == 1


def _format_variants():
    from eval import format_variants

    return format_variants


@pytest.mark.parametrize("bits", [4, 2])
def test_format_variants_token_placement_is_hfkvs_stored_format(bits):
    """The fake quantizer's per-token fp16 variant is bit-identical to what hfkv stores and decodes."""
    import torch

    from hfkv.quant.formats import QuantFormat

    fv = _format_variants()
    x = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(0)) * 3
    fmt = QuantFormat(f"int{bits}", 64, 32, torch.float32)
    assert torch.equal(fv.fake_quant(x, bits, "token", 32, "fp16"), fmt.decode(fmt.encode(x), torch.float32))
    assert fv.metadata_bytes("token", 32, "fp16", 64) + 64 * bits // 8 == fmt.nbytes


def test_format_variants_rotated_groups_spread_an_outlier_channel_at_the_token_formats_bytes():
    import torch

    fv = _format_variants()
    h = fv.hadamard(64)
    assert torch.allclose(h @ h, torch.eye(64), atol=1e-6) and torch.equal(h, h.T)  # orthonormal, its own inverse
    with pytest.raises(ValueError, match="power of two"):
        fv.hadamard(48)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 40, 64, generator=g)
    # Rotated back: with 8-bit codes the round trip stays within the token format's error at 8 bits.
    rot8, tok8 = fv.fake_quant(x, 8, "rotated", 32, "fp32"), fv.fake_quant(x, 8, "token", 32, "fp32")
    assert (rot8 - x).abs().max() < 2 * (tok8 - x).abs().max()
    x[..., 5] *= 50  # an outlier channel: a token's group holding it gets a coarse step for all its elements
    rot, tok = fv.fake_quant(x, 4, "rotated", 32, "fp16"), fv.fake_quant(x, 4, "token", 32, "fp16")
    assert rot.shape == x.shape
    others = [c for c in range(64) if c != 5]
    assert (rot - x)[..., others].abs().mean() < 0.7 * (tok - x)[..., others].abs().mean()
    assert fv.metadata_bytes("rotated", 32, "fp16", 64) == fv.metadata_bytes("token", 32, "fp16", 64)


def test_format_variants_channel_and_page_groups_span_tokens():
    import torch

    fv = _format_variants()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 37, 64, generator=g)
    x[..., 5] *= 50  # an outlier channel: per-channel groups isolate it, per-token groups spread it
    chan = fv.fake_quant(x, 4, "channel", 16, "fp32")
    tok = fv.fake_quant(x, 4, "token", 32, "fp32")
    assert chan.shape == x.shape
    # Error bound of a channel group: half a step of that channel's range over its block of 16 tokens.
    for start in range(0, 37, 16):
        blk = x[:, start : start + 16]
        step = (blk.amax(1) - blk.amin(1)) / 15
        assert ((chan[:, start : start + 16] - blk).abs() <= step.unsqueeze(1) / 2 + 1e-5).all()
    others = [c for c in range(64) if c != 5]
    assert (chan - x)[..., others].abs().mean() < (tok - x)[..., others].abs().mean()
    # Page placement: one scale per group position for the block, so at most 16 distinct levels per block.
    page = fv.fake_quant(x, 4, "page", 16, "fp32")
    assert page[:, :16, :32].unique().numel() <= 16
    assert fv.metadata_bytes("channel", 32, "fp16", 64) == 8 and fv.metadata_bytes("page", 16, "fp16", 64) == 0.5


def test_rotation_fidelity_leaves_the_full_cache_exact_and_changes_what_quantized_tiers_lose():
    """The rotation around the layer is attention-invariant (every token exact: the full cache's log-probs) and reaches
    the quantized tiers (``quant``'s log-probs move); the layer's methods are restored after the context."""
    from contextlib import nullcontext

    import torch

    import hfkv
    from eval.archive import rotation_fidelity as rf
    from hfkv.cache import TriStateLayer
    from hfkv.evaluation.fidelity import reference_logprobs, teacher_forced
    from hfkv.loading import load_model
    from hfkv.testbed import load_test_set

    model, tok = load_model("testbed", dtype="fp32")
    row = load_test_set("kv_recall")[0]
    ids = torch.tensor([tok(row["prompt"] + row["target"])["input_ids"]])
    n = len(tok(row["prompt"])["input_ids"])
    ref = reference_logprobs(model, ids, n)
    before = TriStateLayer.update, TriStateLayer.attend

    def fidelity(preset, wrapped, **kw):
        with rf.rotated_layers() if wrapped else nullcontext():
            return teacher_forced(model, ids, n, lambda: hfkv.TriStateCache(model, preset, **kw), ref)

    # evict with a budget past the sequence keeps every token exact, through the layer's own attention
    full, full_kl = fidelity("evict", True, budget=4096)
    assert full.top1 == 1.0 and float(full_kl.max()) < 1e-5
    assert (TriStateLayer.update, TriStateLayer.attend) == before
    plain, plain_kl = fidelity("quant", False)
    turned, turned_kl = fidelity("quant", True)
    assert turned.kv_bytes == plain.kv_bytes
    assert not torch.allclose(plain_kl, turned_kl)
    # The study's rotation is the cache's own (TriStateConfig.rotate), bit for bit.
    built, built_kl = fidelity("quant", False, rotate=True)
    assert torch.equal(built_kl, turned_kl) and built.kv_bytes == turned.kv_bytes
