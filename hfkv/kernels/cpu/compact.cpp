// Compaction of a tier's slots on CPU: the data movement of hfkv.storage.paged.PagedTiers.remove (its torch
// twin), in one pass per (row, head) instead of three nonzero scans, two page lookups, a gather, a scatter and a
// tag clear (about 35 tensor operations per call, half a millisecond of a policy run at 8k tokens).
//
// A head's kept slots stay a dense prefix with the fewest moves: the j-th hole below the new count (a live slot
// not kept) receives the j-th kept record at or above it, both in slot order; then the tags of the live slots
// past the new count, on pages the head keeps, are zeroed. Freeing the pages past the new count is the caller's.
// A slot's body is `record` bytes at its place in the page; its tag and score lie in the page's tag and score
// regions (`tag_offset` and `tag_offset + 4 * tpp` bytes into the page, 4 bytes a slot: hfkv.storage.record).

#include <cstdint>
#include <cstring>

extern "C" {

// keep [bh_count, m] (bytes 0/1; flags past a head's count ignored), counts [bh_count] at count_stride (old, left
// as they are); new_counts [bh_count] is written: the kept live slots per head.
void hfkv_compact(uint8_t* pool, int64_t page_bytes, const int32_t* table, int64_t bh_count, int32_t table_w,
                  int32_t tpp, int32_t record, int32_t tag_offset, const int64_t* counts, int64_t count_stride,
                  const uint8_t* keep, int32_t m, int64_t* new_counts) {
    for (int64_t bh = 0; bh < bh_count; ++bh) {
        const int64_t old = counts[bh * count_stride];
        const int64_t cnt = old < m ? old : m;
        const uint8_t* k = keep + bh * m;
        int64_t keep_n = 0;
        for (int64_t s = 0; s < cnt; ++s) keep_n += k[s] != 0;
        new_counts[bh] = keep_n;
        const int32_t* pages = table + bh * table_w;
        auto page = [&](int64_t s) { return pool + pages[s / tpp] * page_bytes; };
        auto at = [&](int64_t s) { return page(s) + (s % tpp) * record; };
        auto tag = [&](int64_t s) { return page(s) + tag_offset + (s % tpp) * 4; };
        const int64_t to_score = 4 * static_cast<int64_t>(tpp);
        int64_t src = keep_n;
        for (int64_t hole = 0; hole < keep_n; ++hole) {
            if (k[hole]) continue;
            while (!k[src]) ++src;  // as many kept slots lie at or above keep_n as holes below it
            std::memcpy(at(hole), at(src), record);
            std::memcpy(tag(hole), tag(src), 4);
            std::memcpy(tag(hole) + to_score, tag(src) + to_score, 4);
            ++src;
        }
        const int64_t kept_pages = (keep_n + tpp - 1) / tpp;
        const int64_t clear_end = cnt < kept_pages * tpp ? cnt : kept_pages * tpp;
        for (int64_t s = keep_n; s < clear_end; ++s) std::memset(tag(s), 0, 4);
    }
}

// The rest of a removal (hfkv.kernels.move.release_pages' contract): each head's pages past its new count pushed
// onto free_stack from n_free on (head order, then column order) and nulled in the table, counts set to
// new_counts. Returns the pages freed; *widest gets the widest head's pages.
int64_t hfkv_release(int32_t* table, int64_t bh_count, int32_t table_w, int64_t* counts, int64_t count_stride,
                     const int64_t* new_counts, int32_t tpp, int32_t* free_stack, int64_t n_free, int64_t* widest) {
    int64_t total = 0, wide = 0;
    for (int64_t bh = 0; bh < bh_count; ++bh) {
        const int64_t old_pages = (counts[bh * count_stride] + tpp - 1) / tpp;
        const int64_t new_pages = (new_counts[bh] + tpp - 1) / tpp;
        int32_t* row = table + bh * table_w;
        for (int64_t c = new_pages; c < old_pages; ++c) {
            free_stack[n_free + total + (c - new_pages)] = row[c];
            row[c] = 0;
        }
        total += old_pages > new_pages ? old_pages - new_pages : 0;
        wide = new_pages > wide ? new_pages : wide;
        counts[bh * count_stride] = new_counts[bh];
    }
    *widest = wide;
    return total;
}

}  // extern "C"
