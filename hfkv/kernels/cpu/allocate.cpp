// The memory-budget allocation of hfkv.policy.budget.allocate, in C++: the same decisions without sorting.
//
// allocate() ranks every (token, item) by value per byte and takes the longest prefix of that order whose
// bytes fit the room (exact upgrades past the cap skipped). In torch that is a sort of every item of a row
// and a dozen passes around it, which made a policy run the largest part of a CPU decode step. Only the cut
// matters, not the order on either side of it, so here a row's items are selected, not sorted: a quickselect
// that keeps the side holding the cut (expected linear time), after an nth_element for the cap. The order is
// the torch sort's, (value per byte descending, flattened index ascending), so ties are cut where torch cuts
// them; every float is computed with the same operations in the same precision (fp32, no contraction).

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int8_t kEvicted = 3;
constexpr int kOriginal = 0;

// 16 bytes: the selection's passes move items around, so their size is the passes' memory traffic.
struct Item {
    float eff;
    int32_t cost;
    int32_t index;  // flattened (token, item) index within the row: the tie-break (the caller checks it fits)
    bool exact;     // the item upgrades to the original tier
};

inline bool before(const Item& a, const Item& b) {
    return a.eff > b.eff || (a.eff == b.eff && a.index < b.index);
}

inline uint64_t next_random(uint64_t& seed) {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    return seed >> 33;
}

// Floyd-Rivest style rounds for a large range: a sorted sample of the range estimates where the cut falls (the
// rank at which the sample's costs, scaled to the range, pass the room); two of its items bracketing that rank
// split the range in one pass into before / between / after. The classes that fit are taken whole and the
// search goes on in the one holding the cut, usually the small middle one: about 1.3 passes over the items where
// random single pivots took 2-3 (half of a policy run's allocation at 8k). Returns the range still to search.
constexpr int kSample = 64, kBracket = 8, kSampleFrom = 4096;

void bracket_rounds(std::vector<Item>& items, int64_t& lo, int64_t& hi, int64_t& room, std::vector<uint8_t>& taken,
                    uint64_t& seed) {
    while (hi - lo > kSampleFrom) {
        const int64_t n = hi - lo;
        int64_t pick[kSample];
        for (int i = 0; i < kSample; ++i) pick[i] = lo + static_cast<int64_t>(next_random(seed) % n);
        std::sort(pick, pick + kSample, [&](int64_t a, int64_t b) { return before(items[a], items[b]); });
        int c = kSample;
        double est = 0.0;
        for (int i = 0; i < kSample; ++i) {
            est += static_cast<double>(items[pick[i]].cost) * static_cast<double>(n) / kSample;
            if (est > static_cast<double>(room)) {
                c = i;
                break;
            }
        }
        const Item a = items[pick[c - kBracket > 0 ? c - kBracket : 0]];
        const Item b = items[pick[c + kBracket < kSample ? c + kBracket : kSample - 1]];
        // [lo, x): before a; [x, y): from a up to b (b excluded); [y, hi): b and after
        int64_t x = lo, i = lo, y = hi, cost_x = 0, cost_mid = 0;
        while (i < y) {
            if (before(items[i], a)) {
                cost_x += items[i].cost;
                std::swap(items[i++], items[x++]);
            } else if (before(items[i], b)) {
                cost_mid += items[i++].cost;
            } else {
                std::swap(items[i], items[--y]);
            }
        }
        if (cost_x > room) {
            hi = x;
        } else {
            for (int64_t j = lo; j < x; ++j) taken[items[j].index] = 1;
            room -= cost_x;
            if (cost_mid > room) {
                lo = x;
                hi = y;
            } else {
                for (int64_t j = x; j < y; ++j) taken[items[j].index] = 1;
                room -= cost_mid;
                lo = y;
            }
        }
        if (hi - lo == n) return;  // no progress (a degenerate sample): the single pivots below always make some
    }
}

// Marks `taken` for the longest prefix (in `before` order) of items[lo, hi) whose costs fit `room`;
// returns nothing past the first item that does not fit. Expected O(hi - lo).
void take_prefix(std::vector<Item>& items, int64_t lo, int64_t hi, int64_t room, std::vector<uint8_t>& taken,
                 uint64_t seed) {
    bracket_rounds(items, lo, hi, room, taken, seed);
    while (lo < hi) {
        const int64_t p = lo + static_cast<int64_t>(next_random(seed) % static_cast<uint64_t>(hi - lo));
        std::swap(items[p], items[hi - 1]);
        const Item pivot = items[hi - 1];
        int64_t mid = lo;
        int64_t cost = 0;
        for (int64_t i = lo; i < hi - 1; ++i) {
            if (before(items[i], pivot)) {
                cost += items[i].cost;
                std::swap(items[i], items[mid++]);
            }
        }
        std::swap(items[mid], items[hi - 1]);  // pivot at `mid`: [lo, mid) before it, (mid, hi) after
        if (cost > room) {
            hi = mid;  // the cut is among the items before the pivot
            continue;
        }
        for (int64_t i = lo; i < mid; ++i) taken[items[i].index] = 1;
        room -= cost;
        if (items[mid].cost > room) return;  // the pivot is the first item that does not fit
        taken[items[mid].index] = 1;
        room -= items[mid].cost;
        lo = mid + 1;
    }
}

}  // namespace

extern "C" {

// scores f32 / state i8 / sink u8: [B, H, N]; length i64 [B]; alpha_h, alpha_l f32 [H]; room i64 and cap i64
// (or null): [B, H], or [B] with head sharing; tables for state s (0..2) and item j (0..K-1): present[s * K + j],
// rate[s * K + j]; step_cost[j], target[j]; exact_rate: an exact-only token's value per byte; prior: in units of
// 1 / N. out i8 [B, H, N].
void hfkv_allocate(const float* scores, const int8_t* state, const uint8_t* sink, const int64_t* length,
                   const float* alpha_h, const float* alpha_l, const int64_t* room, const int64_t* cap,
                   const int64_t* cost, int32_t B, int32_t H, int32_t N, int32_t K, const uint8_t* present,
                   const float* rate, const int64_t* step_cost, const int8_t* target, float exact_rate,
                   float prior, int32_t head_adaptive, int8_t* out) {
    const int64_t rows = head_adaptive ? B : static_cast<int64_t>(B) * H;
    const int heads_per_row = head_adaptive ? H : 1;
    // Floors first, every row: what allocate() calls `new`.
    for (int64_t i = 0; i < static_cast<int64_t>(B) * H * N; ++i) out[i] = state[i];
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t b = head_adaptive ? r : r / H;
        const float len = static_cast<float>(length[b] < 1 ? 1 : length[b]);
        const float prior_term = (1.0f / len) * prior;  // torch's `prior / length` is reciprocal(length) * prior
        int64_t left = room[r], held = 0, exact = 0;
        std::vector<Item> items;
        items.reserve(static_cast<size_t>(N) * heads_per_row * K);
        for (int hh = 0; hh < heads_per_row; ++hh) {
            const int h = head_adaptive ? hh : static_cast<int>(r % H);
            const int64_t base = (b * H + h) * static_cast<int64_t>(N);
            const float floor_l = alpha_l[h] / len;
            for (int n = 0; n < N; ++n) {
                const int64_t i = base + n;
                int8_t s = state[i];
                if (!sink[i] && scores[i] < floor_l) s = kEvicted;
                out[i] = s;
                if (s == kEvicted) continue;
                if (sink[i]) {
                    left -= cost[s];
                    continue;
                }
                held += cost[s];
                exact += s == kOriginal;
            }
        }
        const bool fits = held <= left && (cap == nullptr || exact <= cap[r]);
        if (fits) continue;  // nothing moves (allocate()'s fast path, row by row: the same decisions)
        for (int hh = 0; hh < heads_per_row; ++hh) {
            const int h = head_adaptive ? hh : static_cast<int>(r % H);
            const int64_t base = (b * H + h) * static_cast<int64_t>(N);
            const float floor_h = alpha_h[h] / len;
            for (int n = 0; n < N; ++n) {
                const int64_t i = base + n;
                const int8_t s = out[i];
                if (sink[i] || s == kEvicted) continue;
                const bool exact_only = s == kOriginal && scores[i] >= floor_h;
                const float value = scores[i] + prior_term;
                const int64_t flat = head_adaptive ? static_cast<int64_t>(n) * H + h : n;
                for (int j = 0; j < K; ++j) {
                    if (!present[s * K + j]) continue;
                    const float eff = value * (exact_only ? exact_rate : rate[s * K + j]);
                    items.push_back(Item{eff, static_cast<int32_t>(step_cost[j]), static_cast<int32_t>(flat * K + j),
                                         target[j] == kOriginal});
                }
            }
        }
        // The cap: exact upgrades past the cap-th (in rank order) are skipped, not a stop.
        if (cap != nullptr) {
            // (order within each side is irrelevant: every step after ranks by `before`, a total order)
            auto mid = std::partition(items.begin(), items.end(), [](const Item& it) { return it.exact; });
            const int64_t n_exact = mid - items.begin(), keep = cap[r] < 0 ? 0 : cap[r];
            if (n_exact > keep) {
                std::nth_element(items.begin(), items.begin() + keep, mid, before);
                items.erase(items.begin() + keep, mid);
            }
        }
        const int64_t slots = static_cast<int64_t>(N) * heads_per_row * K;
        std::vector<uint8_t> taken(slots, 0);
        take_prefix(items, 0, static_cast<int64_t>(items.size()), left, taken, 0x9E3779B97F4A7C15ULL ^ r);
        // A token takes a prefix of its items: it ends in the tier its last taken item reaches.
        for (int hh = 0; hh < heads_per_row; ++hh) {
            const int h = head_adaptive ? hh : static_cast<int>(r % H);
            const int64_t base = (b * H + h) * static_cast<int64_t>(N);
            for (int n = 0; n < N; ++n) {
                const int64_t i = base + n;
                if (sink[i] || out[i] == kEvicted) continue;
                const int64_t flat = (head_adaptive ? static_cast<int64_t>(n) * H + h : n) * K;
                int m = 0;
                for (int j = 0; j < K; ++j) m += taken[flat + j];
                out[i] = m > 0 ? target[m - 1] : kEvicted;
            }
        }
    }
}

}  // extern "C"
