// A prompt's observation-window scores on CPU: from the logits of the last w queries over the prompt's T keys,
// each KV head's score sums (the query heads of a group reduced, the w queries summed) and the mass each key
// received, in one pass per (row, KV head). The torch path (hfkv.policy.observation_probs, token_scores and the
// sum in oq_score) spends a dozen tensor operations a layer on them, each a pass over the [B, Hq, w, T]
// probabilities: at a 512-token prompt on SmolLM2 a third of what hfkv adds to a prefill. The logits come from the
// caller's matmul (the torch path's own: the same products); the causal softmax, the reductions and the sums here.
//
// Twin: hfkv.kernels.observation.observation_scores_reference (hfkv/kernels/cpu/observation.py calls this).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

namespace {

enum Reduction : int32_t { RED_MAX = 0, RED_MEAN = 1, RED_L2 = 2 };

// Row r of one (row, KV head)'s logits [G * w, T] (query head j = r / w of the group, window query i = r % w)
// sees keys 0 .. T - w + i: its causal softmax in place, zeros past them.
void softmax_row(float* x, int64_t T, int64_t seen) {
    Vec mv = {};
    mv -= INFINITY;
    int64_t t = 0;
    for (; t + kLanes <= seen; t += kLanes) {
        const Vec v = load_vec(x + t);
        mv = v > mv ? v : mv;
    }
    float m = -INFINITY;
    for (int i = 0; i < kLanes; ++i) m = mv[i] > m ? mv[i] : m;
    for (; t < seen; ++t) m = x[t] > m ? x[t] : m;
    Vec sv = {};
    for (t = 0; t + kLanes <= seen; t += kLanes) {
        const Vec e = exp_nonpositive(load_vec(x + t) - m);
        store_vec(x + t, e);
        sv += e;
    }
    float sum = lane_sum(sv);
    for (; t < seen; ++t) {
        Vec one = {};
        one[0] = x[t] - m;
        x[t] = exp_nonpositive(one)[0];
        sum += x[t];
    }
    const float inv = 1.0f / sum;
    for (t = 0; t < seen; ++t) x[t] *= inv;
    for (; t < T; ++t) x[t] = 0.0f;
}

}  // namespace

extern "C" {

// logits [BH, G * w, T] fp32 (rows ordered (query head of the group, window query); overwritten with the
// probabilities); sums [BH, T]: per key, the group's probabilities reduced (max, mean or root mean square) and
// summed over the window; mass [BH, T]: the probabilities summed over the group and the window (the caller sums
// the KV heads of a batch row). The window's queries sit at the last w of the T positions (plain causal).
void hfkv_observation_scores(float* logits, int64_t BH, int32_t G, int32_t w, int64_t T, int32_t reduction,
                             float* sums, float* mass, int32_t threads) {
#pragma omp parallel num_threads(threads) if (threads > 1 && BH > 1)
    {
        std::vector<float> red(static_cast<size_t>(T)), total(static_cast<size_t>(T));
#pragma omp for schedule(dynamic, 1)
        for (int64_t bh = 0; bh < BH; ++bh) {
            float* p = logits + bh * G * w * T;
            float* s = sums + bh * T;
            float* ms = mass + bh * T;
            for (int r = 0; r < G * w; ++r) softmax_row(p + r * T, T, T - w + r % w + 1);
            std::memset(s, 0, sizeof(float) * static_cast<size_t>(T));
            std::memset(ms, 0, sizeof(float) * static_cast<size_t>(T));
            for (int i = 0; i < w; ++i) {
                const int64_t seen = T - w + i + 1;  // past it every head of the group holds zeros
                std::fill(red.begin(), red.begin() + seen, 0.0f);  // probabilities are >= 0: also max's start
                std::fill(total.begin(), total.begin() + seen, 0.0f);
                for (int j = 0; j < G; ++j) {  // element-wise loops over the keys (vectorised by the compiler)
                    const float* x = p + (j * w + i) * T;
                    for (int64_t t = 0; t < seen; ++t) total[t] += x[t];
                    if (reduction == RED_MAX) {
                        for (int64_t t = 0; t < seen; ++t) red[t] = x[t] > red[t] ? x[t] : red[t];
                    } else if (reduction == RED_L2) {
                        for (int64_t t = 0; t < seen; ++t) red[t] += x[t] * x[t];
                    }
                }
                for (int64_t t = 0; t < seen; ++t) {
                    float r = red[t];
                    if (reduction == RED_MEAN) r = total[t] / static_cast<float>(G);
                    else if (reduction == RED_L2) r = std::sqrt(r / static_cast<float>(G));
                    s[t] += r;
                    ms[t] += total[t];
                }
            }
        }
    }
}

}  // extern "C"
