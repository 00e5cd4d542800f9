"""A prompt's observation-window scores on CPU tensors: :func:`hfkv.kernels.observation.observation_scores`'s
contract, the logits by torch's matmul (the torch path's own products) and the causal softmax, the GQA reduction and
the sums by the C++ of ``observation.cpp`` (why: that file's header). Twin:
:func:`hfkv.kernels.observation.observation_scores_reference`; the tests compare the two.
"""

from __future__ import annotations

import torch

from hfkv.kernels.cpu.build import function
from hfkv.policy.scores import GQA_REDUCTIONS, observation_shape

__all__ = ["observation_scores_cpu"]


def observation_scores_cpu(
    query: torch.Tensor, key: torch.Tensor, scaling: float, obs_window: int, reduction: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sums [B, H, T], mass [B, T])`` fp32 of the last ``w = min(obs_window, Tq)`` queries of ``query [B, Hq, Tq,
    D]`` over ``key [B, H, T, D]`` (``T >= Tq``, plain causal: no padding), as
    :func:`~hfkv.kernels.observation.observation_scores` returns them; CPU tensors, any float dtype."""
    bsz, heads, t, tq, group, w = observation_shape(query, key, obs_window, reduction, "observation_scores_cpu")
    if query.device.type != "cpu" or key.device.type != "cpu":
        raise ValueError(f"observation_scores_cpu: tensors must be on the CPU, got {query.device} / {key.device}")
    dim = query.shape[3]
    if not (bsz and t and w):  # nothing observed: zero scores and mass
        sums = torch.zeros(bsz, heads, t, dtype=torch.float32)
        return sums, sums.sum(1)
    # observation_probs' products: the window's queries scaled in fp32, then one matmul per KV head's group rows
    q = (query[:, :, tq - w :, :].to(torch.float32) * scaling).reshape(bsz, heads, group * w, dim)
    logits = torch.matmul(q, key.to(torch.float32).transpose(-1, -2)).contiguous()  # [B, H, g * w, T]
    sums = torch.empty(bsz, heads, t, dtype=torch.float32)
    mass = torch.empty(bsz, heads, t, dtype=torch.float32)
    function("hfkv_observation_scores", "p i64 i32 i32 i64 i32 p p i32")(
        logits.data_ptr(), bsz * heads, group, w, t, GQA_REDUCTIONS.index(reduction), sums.data_ptr(),
        mass.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return sums, mass.sum(1)
