// Positions and score sums of a tier's slots on CPU: hfkv.storage.paged.PagedTiers.read_meta's contract (its torch
// twin), read in one pass over the page tables.
//
// A policy run reads the metadata of every slot of every tier; the torch path builds slot indices, page lookups,
// masks and two strided gathers per tier (a dozen tensor operations, a millisecond per run at 8k tokens).

#include <cstdint>
#include <cstring>

extern "C" {

// For every (row, head) bh < bh_count and slot s < m: pos = tag - 1 and the score sum of the slot where it lies,
// valid = s < counts[bh]; invalid slots read as the all-zero null page does (pos -1, score 0).
void hfkv_read_meta(const uint8_t* pool, int64_t page_bytes, const int32_t* table, int64_t bh_count, int32_t table_w,
                    int32_t tpp, int32_t record, int32_t tag_offset, int32_t score_offset, const int64_t* counts,
                    int32_t m, int32_t* pos, float* score, bool* valid) {
    for (int64_t bh = 0; bh < bh_count; ++bh) {
        const int64_t n = counts[bh] < m ? counts[bh] : m;
        int32_t* p = pos + bh * m;
        float* sc = score + bh * m;
        bool* ok = valid + bh * m;
        int64_t s = 0;
        for (int32_t col = 0; col < table_w && s < n; ++col) {
            const uint8_t* rec = pool + static_cast<int64_t>(table[bh * table_w + col]) * page_bytes;
            for (int32_t i = 0; i < tpp && s < n; ++i, ++s, rec += record) {
                int32_t tag;
                std::memcpy(&tag, rec + tag_offset, 4);
                std::memcpy(sc + s, rec + score_offset, 4);
                p[s] = tag - 1;
                ok[s] = true;
            }
        }
        for (; s < m; ++s) {
            p[s] = -1;
            sc[s] = 0.0f;
            ok[s] = false;
        }
    }
}

}  // extern "C"
