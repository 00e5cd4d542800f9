"""Brute-force, loop-based reference of ``hfkv.policy.unified.classify``.

Written directly from the rules (DESIGN §3 "The unified policy"), token by token with plain Python
and ``sorted(key=...)``; it does not call any hfkv policy code. Numerics shared with the
vectorised version by definition: thresholds ``alpha / N`` and the OQ cap product are fp32
operations (numpy.float32), the cap is rounded half to even.
"""

from __future__ import annotations

import math

import numpy as np

from hfkv.states import EVICTED, ORIGINAL, QUANTIZED


def _as_list(x):
    return x.tolist() if hasattr(x, "tolist") else list(x)


def reference_classify(
    scores,
    state,
    sink,
    logical_len,
    window_count,
    alpha_h,
    alpha_l,
    budget,
    window,
    slack,
    head_adaptive,
    rho,
):
    """Same contract as ``classify``; returns nested lists ``[B][H][N]`` of ints."""
    sc = _as_list(scores)
    st = _as_list(state)
    sk = _as_list(sink)
    lens = [int(v) for v in _as_list(logical_len)]
    wcs = [int(v) for v in _as_list(window_count)]
    b_n = len(sc)
    h_n = len(sc[0]) if b_n else 0
    n_n = len(sc[0][0]) if h_n else 0
    a_h = [float(v) for v in np.asarray(alpha_h, dtype=np.float32).reshape(-1)]
    a_l = [float(v) for v in np.asarray(alpha_l, dtype=np.float32).reshape(-1)]
    if len(a_h) == 1:
        a_h = a_h * h_n
    if len(a_l) == 1:
        a_l = a_l * h_n

    out = [[[int(st[b][h][n]) for n in range(n_n)] for h in range(h_n)] for b in range(b_n)]

    # Rule 1: thresholds, no promotion, sinks untouched.
    for b in range(b_n):
        length = np.float32(max(1, lens[b]))
        for h in range(h_n):
            thr_l = np.float32(a_l[h]) / length
            thr_h = np.float32(a_h[h]) / length
            for n in range(n_n):
                if sk[b][h][n] or out[b][h][n] == EVICTED:
                    continue
                s = np.float32(sc[b][h][n])
                if s < thr_l:
                    proposed = EVICTED
                elif s >= thr_h:
                    proposed = ORIGINAL
                else:
                    proposed = QUANTIZED
                out[b][h][n] = max(out[b][h][n], proposed)

    if budget is None:
        return out

    # Rule 2: budget tailor.
    target = max(0, math.floor(slack * (budget - window)))
    for b in range(b_n):
        if head_adaptive:
            kept = [(h, n) for h in range(h_n) for n in range(n_n) if out[b][h][n] != EVICTED]
            if len(kept) + h_n * wcs[b] > h_n * budget:
                cands = sorted(
                    [(h, n) for (h, n) in kept if not sk[b][h][n]],
                    key=lambda hn, b=b: (sc[b][hn[0]][hn[1]], hn[1], hn[0]),
                )
                remaining = len(kept)
                for h, n in cands:
                    if remaining <= h_n * target:
                        break
                    out[b][h][n] = EVICTED
                    remaining -= 1
        else:
            for h in range(h_n):
                kept = [n for n in range(n_n) if out[b][h][n] != EVICTED]
                if len(kept) + wcs[b] > budget:
                    cands = sorted(
                        [n for n in kept if not sk[b][h][n]],
                        key=lambda n, b=b, h=h: (sc[b][h][n], n),
                    )
                    remaining = len(kept)
                    for n in cands:
                        if remaining <= target:
                            break
                        out[b][h][n] = EVICTED
                        remaining -= 1

    if rho is None:
        return out

    # Rule 3: OQ cap.
    rhos = [float(v) for v in np.asarray(rho, dtype=np.float32).reshape(-1)]
    for b in range(b_n):
        cap = max(0, int(np.round(np.float32(rhos[b]) * np.float32(budget - window))))
        if head_adaptive:
            origs = [(h, n) for h in range(h_n) for n in range(n_n) if out[b][h][n] == ORIGINAL and not sk[b][h][n]]
            surplus = len(origs) - h_n * cap
            if surplus > 0:
                origs.sort(key=lambda hn, b=b: (sc[b][hn[0]][hn[1]], hn[1], hn[0]))
                for h, n in origs[:surplus]:
                    out[b][h][n] = QUANTIZED
        else:
            for h in range(h_n):
                origs = [n for n in range(n_n) if out[b][h][n] == ORIGINAL and not sk[b][h][n]]
                surplus = len(origs) - cap
                if surplus > 0:
                    origs.sort(key=lambda n, b=b, h=h: (sc[b][h][n], n))
                    for n in origs[:surplus]:
                        out[b][h][n] = QUANTIZED
    return out
