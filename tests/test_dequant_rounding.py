"""eval/dequant_rounding.py: the emulation that settled the partial pass's dequantization form (docs/kernels.md)."""

import pytest
import torch

from eval import dequant_rounding as dr


def test_attention_without_rounding_is_masked_softmax_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, s, 16, generator=g, dtype=torch.float64) for s in (4, 40, 40))
    live = torch.rand(2, 3, 40, generator=g) > 0.3
    mask = torch.where(live[:, :, None, :], 0.0, float("-inf")).double()
    want = torch.softmax(q @ k.transpose(-1, -2) + mask, -1) @ v
    torch.testing.assert_close(dr.attention(q, k, v, live, (None,) * 4), want, rtol=1e-12, atol=1e-12)
    # a form rounds what it names: the values alone in bf16 is exact attention over bf16 values
    bf16_v = dr.attention(q, k, v, live, (None, None, torch.bfloat16, None))
    torch.testing.assert_close(bf16_v, torch.softmax(q @ k.transpose(-1, -2) + mask, -1) @ v.bfloat16().double())


def test_random_storage_puts_the_bf16_form_further_from_exact_than_the_fp16_form():
    (row,) = dr.random_cases([2048], ["int4/int2"])
    d = row["distance_from_exact"]
    assert set(d) == set(dr.FORMS)
    half, bf16 = d["fp16 dequantization (fp16 operands)"], d["fp32 dequantization (bf16 operands)"]
    assert 0 < half < bf16 < 0.05
    assert d["values alone in bf16"] > 0.5 * bf16  # the values' rounding is most of it
    assert row["values_bf16_mean_error_rms"] > 10 * row["unbiased_mean_error_rms"]  # a bias, not noise


def test_unknown_source_or_format_is_refused_with_the_allowed_ones(tmp_path, capsys):
    with pytest.raises(SystemExit):
        dr.main(["--out", str(tmp_path / "x.json"), "--sources", "random,gpu"])
    assert "allowed: random, smollm2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        dr.main(["--out", str(tmp_path / "x.json"), "--sources", "random", "--formats", "int4/fp8"])
    assert "--formats='int4/fp8': allowed: KEY/VALUE pairs of int8, int4, int2" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
