// Positions and score sums of a tier's slots on CPU: hfkv.storage.paged.PagedTiers.read_meta's contract (its torch
// twin), read in one pass over the page tables.
//
// A policy run reads the metadata of every slot of every tier; the torch path builds slot indices, page lookups,
// masks and two strided gathers per tier (a dozen tensor operations, a millisecond per run at 8k tokens).

#include <cstdint>
#include <cstring>

namespace {

// Slots [0, live) of one (row, head) of a tier, page by page through its table row (no division per slot): fn(s,
// tag, score) with the slot's tag (position + 1) and score sum, read from its page's regions, tag_offset and
// score_offset bytes into it, 4 bytes a slot (hfkv.storage.record). Returns the slots read.
template <class F>
inline int64_t walk_slots(const uint8_t* pool, int64_t page_bytes, const int32_t* table_row, int32_t table_w,
                          int32_t tpp, int32_t tag_offset, int32_t score_offset, int64_t live, F&& fn) {
    int64_t s = 0;
    for (int32_t col = 0; col < table_w && s < live; ++col) {
        const uint8_t* page = pool + static_cast<int64_t>(table_row[col]) * page_bytes;
        for (int32_t i = 0; i < tpp && s < live; ++i, ++s) {
            int32_t tag;
            float score;
            std::memcpy(&tag, page + tag_offset + 4 * i, 4);
            std::memcpy(&score, page + score_offset + 4 * i, 4);
            fn(s, tag, score);
        }
    }
    return s;
}

}  // namespace

extern "C" {

// For every (row, head) bh < bh_count and slot s < m: pos = tag - 1 and the score sum of the slot where it lies,
// valid = s < counts[bh]; invalid slots read as the all-zero null page does (pos -1, score 0).
void hfkv_read_meta(const uint8_t* pool, int64_t page_bytes, const int32_t* table, int64_t bh_count, int32_t table_w,
                    int32_t tpp, int32_t tag_offset, int32_t score_offset, const int64_t* counts,
                    int32_t m, int32_t* pos, float* score, bool* valid) {
    for (int64_t bh = 0; bh < bh_count; ++bh) {
        const int64_t n = counts[bh] < m ? counts[bh] : m;
        int32_t* p = pos + bh * m;
        float* sc = score + bh * m;
        bool* ok = valid + bh * m;
        int64_t s = walk_slots(pool, page_bytes, table + bh * table_w, table_w, tpp, tag_offset, score_offset, n,
                               [&](int64_t j, int32_t tag, float v) {
                                   p[j] = tag - 1;
                                   sc[j] = v;
                                   ok[j] = true;
                               });
        for (; s < m; ++s) {
            p[s] = -1;
            sc[s] = 0.0f;
            ok[s] = false;
        }
    }
}

}  // extern "C"

extern "C" {

// What a policy run's decisions change, per tier (hfkv.kernels.changes.tier_changes_reference's contract, its torch
// twin: four tensor operations and a host read per tier and question): for tier t, the slots [ends[t-1], ends[t])
// of each of the `rows` rows of new / valid [rows, n]: how many valid ones move to a lower tier they are kept in
// (t < new != evicted) and how many leave (new != t). out [2 * tiers]: (demoted, leaving) per tier.
void hfkv_tier_changes(const int8_t* fresh, const uint8_t* valid, int64_t rows, int64_t n, const int64_t* ends,
                       int32_t tiers, int32_t evicted, int64_t* out) {
    for (int32_t t = 0; t < 2 * tiers; ++t) out[t] = 0;
    for (int64_t r = 0; r < rows; ++r) {
        const int8_t* nw = fresh + r * n;
        const uint8_t* ok = valid + r * n;
        int64_t i = 0;
        for (int32_t t = 0; t < tiers; ++t) {
            int64_t demoted = 0, leaving = 0;
            for (; i < ends[t]; ++i) {
                const int32_t x = nw[i];
                const bool live = ok[i] != 0;
                demoted += live && x > t && x != evicted;
                leaving += live && x != t;
            }
            out[2 * t] += demoted;
            out[2 * t + 1] += leaving;
        }
    }
}

}  // extern "C"

extern "C" {

// A policy run's candidates in one pass: every tier's slots [0, m[t]) (as hfkv_read_meta reads them), then the
// window's exits, side by side in rows of n = sum(m) + n_exit columns (hfkv.storage.paged.PagedTiers.candidates'
// contract, its torch twin: a read per tier, four concatenations, a fill and a select, a dozen tensor operations).
// tier t: pool offsets and table/counts pointers per tier in the arrays; counts [bh, tiers] row-major. Exits: pos
// [n_exit] and score [bh, n_exit]; an exit is a candidate for tier `original` unless its position is below the
// row's pad_end (padding: evicted). state = the slot's tier, or `evicted` where not valid.
void hfkv_read_candidates(const uint8_t* pool, int64_t page_bytes, int32_t tiers, const int32_t* const* tables,
                          const int32_t* table_w, const int32_t* tpp, const int32_t* tag_offset,
                          const int32_t* score_offset, const int64_t* counts, const int32_t* m, int64_t B, int64_t H,
                          const int64_t* exit_pos, const float* exit_score, int32_t n_exit, const int64_t* pad_end,
                          int8_t original, int8_t evicted, int64_t* pos, float* score, bool* valid, int8_t* state) {
    int64_t n = n_exit;
    for (int32_t t = 0; t < tiers; ++t) n += m[t];
    for (int64_t bh = 0; bh < B * H; ++bh) {
        int64_t col = bh * n;
        for (int32_t t = 0; t < tiers; ++t) {
            const int64_t cnt = counts[bh * tiers + t], live = cnt < m[t] ? cnt : m[t];
            int64_t s = walk_slots(pool, page_bytes, tables[t] + bh * table_w[t], table_w[t], tpp[t], tag_offset[t],
                                   score_offset[t], live, [&](int64_t j, int32_t tag, float v) {
                                       pos[col + j] = static_cast<int64_t>(tag) - 1;
                                       score[col + j] = v;
                                       valid[col + j] = true;
                                       state[col + j] = static_cast<int8_t>(t);
                                   });
            for (; s < m[t]; ++s) {
                pos[col + s] = -1;
                score[col + s] = 0.0f;
                valid[col + s] = false;
                state[col + s] = evicted;
            }
            col += m[t];
        }
        const int64_t pad = pad_end[bh / H];
        for (int32_t i = 0; i < n_exit; ++i) {
            const bool ok = exit_pos[i] >= pad;
            pos[col + i] = exit_pos[i];
            score[col + i] = exit_score[bh * n_exit + i];
            valid[col + i] = ok;
            state[col + i] = ok ? original : evicted;
        }
    }
}

}  // extern "C"
