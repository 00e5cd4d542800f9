"""Brute-force, loop-based reference of ``hfkv.policy.unified.classify``.

Written directly from the rules (DESIGN §3 "The unified policy"), token by token with plain Python
and ``sorted(key=...)``; it does not call any hfkv policy code. Numerics shared with the
vectorised version by definition: thresholds ``alpha / N`` and the OQ cap product are fp32
operations (numpy.float32), the cap is rounded half to even.
"""

from __future__ import annotations

import math

import numpy as np

from hfkv.states import EVICTED, MID, ORIGINAL, QUANTIZED


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


def _hull_rates(points):
    """Slope of the upper concave hull of ``(0, 0)`` and ``points`` (cheapest first) over each step, by
    Andrew's monotone chain; a zero-cost step takes the previous step's slope."""
    hull = [(0.0, 0.0)]
    for x, f in points:
        x, f = float(x), float(f)
        while hull and hull[-1][0] == x:  # a vertical rise: the higher point replaces the lower one
            if hull[-1][1] >= f:
                break
            hull.pop()
        else:
            while len(hull) >= 2:
                (ox, of), (ax, af) = hull[-2], hull[-1]
                if (ax - ox) * (f - of) - (af - of) * (x - ox) >= 0:  # the middle point is on or under
                    hull.pop()
                else:
                    break
            hull.append((x, f))
    rates, prev = [], 0.0
    for x, _ in points:
        x = float(x)
        if x == prev:
            rates.append(rates[-1])
            continue
        seg = next(k for k in range(1, len(hull)) if hull[k][0] >= x)
        (ax, af), (bx, bf) = hull[seg - 1], hull[seg]
        rates.append((bf - af) / (bx - ax))
        prev = x
    return rates


def reference_allocate(
    scores, state, sink, logical_len, alpha_h, alpha_l, room, cost, fidelity, head_adaptive, exact_cap=None, prior=0.0
):
    """Loop version of ``hfkv.policy.budget.allocate``, written from its docstring; nested lists out.

    Items per token: one per tier it may still be in (no promotion), cheapest first, each costing the
    step from the previous option (evicted first); rated at the hull slope of the token's options
    (fp32; all items of a token at or above alpha_h / N at the exact tier's rate). Order: rate, then slot,
    head, item. Items are taken in order while their cumulative cost fits the room left after the sinks;
    items reaching the exact tier past ``exact_cap`` are skipped. A token ends in the tier its last item
    reaches.
    """
    sc, st, sk = _as_list(scores), _as_list(state), _as_list(sink)
    lens = [int(v) for v in _as_list(logical_len)]
    b_n, h_n, n_n = len(sc), len(sc[0]), len(sc[0][0])
    a_h = [float(v) for v in np.asarray(alpha_h, dtype=np.float32).reshape(-1)]
    a_l = [float(v) for v in np.asarray(alpha_l, dtype=np.float32).reshape(-1)]
    a_h = a_h * h_n if len(a_h) == 1 else a_h
    a_l = a_l * h_n if len(a_l) == 1 else a_l
    order = [t for t in (QUANTIZED, MID, ORIGINAL) if cost[t] is not None]  # cheapest first
    byte = {t: cost[t] for t in order}
    e_rate = np.float32(fidelity[ORIGINAL] / cost[ORIGINAL])

    def options(cur):
        allowed = [t for t in order if t >= cur]
        rates = _hull_rates([(cost[t], fidelity[t]) for t in allowed])
        steps = [byte[t] - (byte[allowed[j - 1]] if j else 0) for j, t in enumerate(allowed)]
        return allowed, [np.float32(r) for r in rates], steps

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
                    sink_bytes += byte.get(cur, 0)
                    continue
                if cur != EVICTED and s < np.float32(a_l[h]) / length:
                    out[b][h][n] = cur = EVICTED
                if cur == EVICTED:
                    continue
                cand.append((b, h, n))
                exact_only = cur == ORIGINAL and s >= np.float32(a_h[h]) / length
                if prior:
                    s = np.float32(s + np.float32(prior) / length)
                allowed, rates, steps = options(cur)
                for j, (t, r, c) in enumerate(zip(allowed, rates, steps, strict=True)):
                    items.append((-_f32_key(s * (e_rate if exact_only else r)), n, h, j, b, c, t))
        r = room_l[b0] if head_adaptive else room_l[b0][heads[0][1]]
        cap = None if cap_l is None else (cap_l[b0] if head_adaptive else cap_l[b0][heads[0][1]])
        left = r - sink_bytes
        need_now = sum(byte[out[b][h][n]] for b, h, n in cand)
        n_exact = sum(out[b][h][n] == ORIGINAL for b, h, n in cand)
        if need_now <= left and (cap is None or n_exact <= cap):
            continue  # (the vectorised version decides this for all rows at once; same result)
        taken: dict[tuple[int, int, int], list[int]] = {c: [] for c in cand}
        final: dict[tuple[int, int, int], int] = {}
        spent, ups, stopped = 0, 0, False
        for _, n, h, j, b, c, t in sorted(items, key=lambda it: it[:4]):
            if t == ORIGINAL and cap is not None:
                if ups >= cap:
                    continue
                ups += 1
            if stopped or spent + c > left:
                stopped = True
                continue
            spent += c
            taken[(b, h, n)].append(j)
            final[(b, h, n)] = t
        for key in cand:
            assert taken[key] == list(range(len(taken[key]))), "a token takes a prefix of its items"
            out[key[0]][key[1]][key[2]] = final.get(key, EVICTED)
    return out
