// Slots for appended records on CPU: hfkv.storage.paged.PagedTiers._reserve's contract (its torch twin; the
// Triton backend's is hfkv/kernels/reserve.py). Appending takes each head's next slots: new pages where a head's
// last one is full (their ids written into the page table, their bytes zeroed: a reused page may hold another
// tier's tags) and each record's byte offset. The torch path is some twenty tensor operations (a repeat-interleave
// of page owners, cumulative sums, scattered table writes, gathered page ids) for a policy run's few dozen
// records; here one pass over the heads.

#include <cstdint>
#include <cstring>

extern "C" {

// old [heads] records held, k [heads] appended (records grouped by head, in head order), ids: the new pages, as
// many as the heads need, taken in head order; table [heads, table_w] (wide enough), written; out [sum k] offsets.
void hfkv_reserve(uint8_t* pool, int64_t page_bytes, int32_t* table, int32_t table_w, const int64_t* old,
                  const int64_t* k, const int32_t* ids, int64_t heads, int32_t tpp, int32_t record, int64_t* out) {
    int64_t first = 0, start = 0;
    for (int64_t bh = 0; bh < heads; ++bh) {
        const int64_t o = old[bh], n = k[bh];
        const int64_t have = (o + tpp - 1) / tpp, need = (o + n + tpp - 1) / tpp - have;
        int32_t* row = table + bh * table_w;
        for (int64_t c = 0; c < need; ++c) {
            row[have + c] = ids[start + c];
            std::memset(pool + static_cast<int64_t>(ids[start + c]) * page_bytes, 0, static_cast<size_t>(page_bytes));
        }
        for (int64_t j = 0; j < n; ++j) {
            const int64_t s = o + j;
            out[first + j] = static_cast<int64_t>(row[s / tpp]) * page_bytes + (s % tpp) * record;
        }
        first += n;
        start += need;
    }
}

// What an append needs before pages are handed out (hfkv.kernels.reserve.count_appends' contract): k [heads]
// records per head of the n appended ones (heads b * H + h), old [heads] the counts before, counts (at
// count_stride) set to old + k; returns the pages to hand out, *widest the widest head's pages after.
int64_t hfkv_count_appends(const int64_t* b, const int64_t* h, int64_t n, int64_t H, int64_t* counts,
                           int64_t count_stride, int64_t heads, int32_t tpp, int64_t* k, int64_t* old,
                           int64_t* widest) {
    for (int64_t i = 0; i < heads; ++i) k[i] = 0;
    for (int64_t j = 0; j < n; ++j) ++k[b[j] * H + h[j]];
    int64_t total = 0, wide = 0;
    for (int64_t i = 0; i < heads; ++i) {
        const int64_t o = counts[i * count_stride];
        const int64_t have = (o + tpp - 1) / tpp, after = (o + k[i] + tpp - 1) / tpp;
        old[i] = o;
        counts[i * count_stride] = o + k[i];
        total += after - have;
        wide = after > wide ? after : wide;
    }
    *widest = wide;
    return total;
}

}  // extern "C"
