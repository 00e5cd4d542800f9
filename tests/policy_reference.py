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


# ----------------------------------------------------------------------------- memory budget
def _f32_key(x: float) -> float:
    return float(np.float32(x))


def reference_allocate(
    scores, state, sink, logical_len, alpha_h, alpha_l, room, cost, fidelity, head_adaptive, exact_cap=None, prior=0.0
):
    """Loop version of ``hfkv.policy.budget.allocate``, written from its docstring; nested lists out.

    Items per token: keep (cost c1) and upgrade (cost c0 - c1, only for ORIGINAL tokens). Order:
    value per byte (fp32; both items of a token at or above alpha_h / N at the exact tier's rate), then
    slot, head, keep before upgrade. Items are taken in order while their cumulative cost fits the room left after the
    sinks; upgrades past ``exact_cap`` are skipped.
    """
    sc, st, sk = _as_list(scores), _as_list(state), _as_list(sink)
    lens = [int(v) for v in _as_list(logical_len)]
    b_n, h_n, n_n = len(sc), len(sc[0]), len(sc[0][0])
    a_h = [float(v) for v in np.asarray(alpha_h, dtype=np.float32).reshape(-1)]
    a_l = [float(v) for v in np.asarray(alpha_l, dtype=np.float32).reshape(-1)]
    a_h = a_h * h_n if len(a_h) == 1 else a_h
    a_l = a_l * h_n if len(a_l) == 1 else a_l
    c0, c1 = cost
    f0, f1 = fidelity
    pays = f1 * c0 >= f0 * c1
    u_rate = np.float32((f0 - f1) / (c0 - c1) if pays and c0 > c1 else f0 / c0)
    room_l = _as_list(room)
    cap_l = _as_list(exact_cap) if exact_cap is not None else None
    out = [[[int(st[b][h][n]) for n in range(n_n)] for h in range(h_n)] for b in range(b_n)]
    groups = (
        [[(b, h) for h in range(h_n)] for b in range(b_n)]
        if head_adaptive
        else [[(b, h)] for b in range(b_n) for h in range(h_n)]
    )
    for heads in groups:
        b0 = heads[0][0]
        length = np.float32(max(1, lens[b0]))
        items, sink_bytes, cand = [], 0, []
        for n in range(n_n):
            for b, h in heads:
                s, cur = np.float32(sc[b][h][n]), out[b][h][n]
                if sk[b][h][n]:
                    sink_bytes += c0 if cur == ORIGINAL else c1 if cur == QUANTIZED else 0
                    continue
                if cur != EVICTED and s < np.float32(a_l[h]) / length:
                    out[b][h][n] = cur = EVICTED
                if cur == EVICTED:
                    continue
                cand.append((b, h, n))
                exact_only = cur == ORIGINAL and s >= np.float32(a_h[h]) / length
                if prior:
                    s = np.float32(s + np.float32(prior) / length)
                e_rate = np.float32(f0 / c0)
                rate = e_rate if cur == ORIGINAL and (exact_only or not pays) else np.float32(f1 / c1)
                items.append((-_f32_key(s * rate), 0, n, h, b, c1))
                if cur == ORIGINAL:
                    items.append((-_f32_key(s * (e_rate if exact_only else u_rate)), 1, n, h, b, c0 - c1))
        r = room_l[b0] if head_adaptive else room_l[b0][heads[0][1]]
        cap = None if cap_l is None else (cap_l[b0] if head_adaptive else cap_l[b0][heads[0][1]])
        left = r - sink_bytes
        need_now = sum(c0 if out[b][h][n] == ORIGINAL else c1 for b, h, n in cand)
        n_exact = sum(out[b][h][n] == ORIGINAL for b, h, n in cand)
        if need_now <= left and (cap is None or n_exact <= cap):
            continue  # (the vectorised version decides this for all rows at once; same result)
        kept, upgraded, spent, ups = set(), set(), 0, 0
        stopped = False
        for _, kind, n, h, b, c in sorted(items, key=lambda it: (it[0], it[2], it[3], it[1])):
            if kind == 1:
                if cap is not None and ups >= cap:
                    continue
                ups += 1
            if stopped or spent + c > left:
                stopped = True
                continue
            spent += c
            (upgraded if kind else kept).add((b, h, n))
        for b, h, n in cand:
            out[b][h][n] = (ORIGINAL if (b, h, n) in upgraded else QUANTIZED) if (b, h, n) in kept else EVICTED
    return out
