// The q.k half of paged decode attention (paged_attention.cpp has the driver, decode_pv.h
// the softmax and p.V), AVX-512 only.
//
// Numerics (docs/architecture.md, "Attention numerics"): each score is one float32 chain
// over the head's dims in order, exactly as the prefill kernel's microkernel sums it (bf16:
// one vdpbf16ps per dim pair; float32: one FMA per dim), then times the scale. The
// instruction-level parallelism a single chain lacks comes from working on up to four tiles
// of 16 keys, and up to four query rows, at once, never from splitting a sum.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common.h"

#if defined(KVFLOW_AVX512F)
namespace kvflow::decode {

constexpr int kKeyTiles = 4;  // tiles of 16 keys per q.k pass

// Where one tile of 16 keys lies: `cell0` points at dim group 0 of its first key; group g of
// key i is at cell0 + g * block_size * G, plus, when the tile spans blocks (block_size not a
// multiple of 16), byte offset i of `lo`/`hi` (lanes 0-7, 8-15) from the cache's start.
template <typename T>
struct KeyTile {
    const T* cell0;
    __m512i lo, hi;
    __mmask16 valid;  // the tile's real keys
};

template <typename T, bool kGather>
inline __m512i key_cells16(const KeyTile<T>& tile, int64_t g, int64_t block_size) {
    const T* cells = tile.cell0 + g * block_size * kKeyGroup<T>;
    if constexpr (!kGather) {
        return _mm512_loadu_si512(cells);
    } else {
        const __m256i a = _mm512_i64gather_epi32(tile.lo, static_cast<const void*>(cells), 1), b = _mm512_i64gather_epi32(tile.hi, static_cast<const void*>(cells), 1);
        return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
    }
}

// scores[r, tile keys] = scale * q[r] . k for R query rows of one KV head and NK key tiles.
// Keys are dimension-major, so one dim group of a tile's 16 keys is one 64-byte vector and
// each q element (a dim pair in bf16, AVX512-BF16 only) is broadcast into 16 scores at once.
// `pf` steps once per dim group.
template <typename Dt, int NV, int R, int NK, bool kGather>
inline void scores_tiles(const typename Dt::T* q, const KeyTile<typename Dt::T>* tiles, int64_t block_size,
                         __m512 vscale, float* out, int64_t len, PrefetchStream* pf) {
    using T = typename Dt::T;
    constexpr int64_t D = NV * 16, G = kKeyGroup<T>, kGroups = D / G;
    __m512 acc[R][NK];
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < NK; ++i) acc[r][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < kGroups; ++g) {
        __m512i cells[NK];
        for (int i = 0; i < NK; ++i) cells[i] = key_cells16<T, kGather>(tiles[i], g, block_size);
        pf->step();
        for (int r = 0; r < R; ++r) {
            if constexpr (std::is_same_v<Dt, BF16>) {
#if defined(KVFLOW_AVX512BF16)
                int32_t pair;
                std::memcpy(&pair, q + r * D + 2 * g, sizeof(pair));
                const __m512bh qb = (__m512bh)_mm512_set1_epi32(pair);
                for (int i = 0; i < NK; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], qb, (__m512bh)cells[i]);
#endif
            } else {
                const __m512 qb = _mm512_set1_ps(q[r * D + g]);
                for (int i = 0; i < NK; ++i) acc[r][i] = _mm512_fmadd_ps(qb, _mm512_castsi512_ps(cells[i]), acc[r][i]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < NK; ++i)
            _mm512_mask_storeu_ps(out + r * len + i * 16, tiles[i].valid, _mm512_mul_ps(acc[r][i], vscale));
}

// One KV head's query rows [r, r_end) against NK key tiles, up to four rows at a time.
template <typename Dt, int NV, int NK, bool kGather>
inline void head_scores(const typename Dt::T* q, int64_t r, int64_t r_end, const KeyTile<typename Dt::T>* tiles,
                        int64_t block_size, __m512 vscale, float* scores, int64_t len, PrefetchStream* pf) {
    constexpr int64_t D = NV * 16;
    for (; r + 4 <= r_end; r += 4)
        scores_tiles<Dt, NV, 4, NK, kGather>(q + r * D, tiles, block_size, vscale, scores + r * len, len, pf);
    switch (r_end - r) {
        case 3: scores_tiles<Dt, NV, 3, NK, kGather>(q + r * D, tiles, block_size, vscale, scores + r * len, len, pf); break;
        case 2: scores_tiles<Dt, NV, 2, NK, kGather>(q + r * D, tiles, block_size, vscale, scores + r * len, len, pf); break;
        case 1: scores_tiles<Dt, NV, 1, NK, kGather>(q + r * D, tiles, block_size, vscale, scores + r * len, len, pf); break;
        default: break;
    }
}

// A group of kKeyTiles tiles at once; a shorter group (the last of a sequence) one tile at a
// time, which keeps the instantiations (and the build) small.
template <typename Dt, int NV, bool kGather>
inline void head_scores_n(int64_t nk, const typename Dt::T* q, int64_t r, int64_t r_end,
                          const KeyTile<typename Dt::T>* tiles, int64_t block_size, __m512 vscale, float* scores,
                          int64_t len, PrefetchStream* pf) {
    if (nk == kKeyTiles) {
        head_scores<Dt, NV, kKeyTiles, kGather>(q, r, r_end, tiles, block_size, vscale, scores, len, pf);
        return;
    }
    for (int64_t i = 0; i < nk; ++i)
        head_scores<Dt, NV, 1, kGather>(q, r, r_end, tiles + i, block_size, vscale, scores + 16 * i, len, pf);
}

// q.k for an item's KV heads: scores [num_item_heads * group, len]. All heads of a group of
// tiles are done before moving on, so the pool is read once, front to back. While a group
// computes, the next group's blocks stream in (the last group: V's first `v_blocks` blocks). With block_size
// a multiple of 16 a tile lies in one block and is one load per dim group; otherwise its keys
// are gathered from the blocks they span.
template <typename Dt, int NV>
void item_scores(const typename Dt::T* q, const typename Dt::T* key_cache, const int64_t* table, int64_t len,
                 int64_t num_item_heads, int64_t group, int64_t block_size, int64_t block_stride, float scale,
                 float* scores, const typename Dt::T* value_cache, int64_t item_v_bytes, int64_t v_blocks) {
    using T = typename Dt::T;
    constexpr int64_t D = NV * 16, G = kKeyGroup<T>;
    const __m512 vscale = _mm512_set1_ps(scale);
    const bool contiguous = block_size % 16 == 0;
    // The K bytes of one block for this item's heads (contiguous: heads are the block's outer dim).
    const int64_t item_block_bytes = num_item_heads * D * block_size * static_cast<int64_t>(sizeof(T));
    const int64_t num_blocks = (len + block_size - 1) / block_size;
    // The first group's blocks at once, so their misses overlap instead of coming one by one.
    for (int64_t b = 0; b < std::min(num_blocks, (16 * kKeyTiles + block_size - 1) / block_size); ++b)
        prefetch_l2(key_cache + table[b] * block_stride, item_block_bytes);
    for (int64_t t0 = 0; t0 < len; t0 += 16 * kKeyTiles) {
        const int64_t nk = std::min<int64_t>(kKeyTiles, (len - t0 + 15) / 16);
        // The next group of tiles' blocks (they lie scattered), a few lines per dim group.
        const int64_t b_next = (t0 + 16 * kKeyTiles) / block_size,
                      b_last = std::min(num_blocks, (t0 + 32 * kKeyTiles + block_size - 1) / block_size);
        PrefetchStream pf;
        pf.reset(item_block_bytes);
        for (int64_t b = b_next; b < b_last; ++b) pf.add(key_cache + table[b] * block_stride);
        if (b_next >= num_blocks) {
            pf.reset(item_v_bytes);
            for (int64_t b = 0; b < std::min(num_blocks, v_blocks); ++b) pf.add(value_cache + table[b] * block_stride);
        }
        // scores_tiles calls per head: row passes of up to 4 x (one per tile when nk < kKeyTiles), D / G steps each
        pf.spread(num_item_heads * ((group + 3) / 4) * (nk == kKeyTiles ? 1 : nk) * (D / G));
        KeyTile<T> tiles[kKeyTiles];
        for (int64_t i = 0; i < nk; ++i) {
            const int64_t t = t0 + 16 * i;
            tiles[i].valid = tail_mask(len - t);
            if (contiguous) {
                tiles[i].cell0 = key_cache + table[t / block_size] * block_stride + (t % block_size) * G;
                tiles[i].lo = tiles[i].hi = _mm512_setzero_si512();
                continue;
            }
            alignas(64) int64_t offset[16];  // bytes from the cache to each key's first cell
            for (int64_t j = 0; j < 16; ++j) {
                const int64_t tj = std::min(t + j, len - 1);  // past the end: re-read the last key (masked)
                offset[j] = (table[tj / block_size] * block_stride + (tj % block_size) * G) * static_cast<int64_t>(sizeof(T));
            }
            tiles[i].cell0 = key_cache;
            tiles[i].lo = _mm512_load_si512(offset);
            tiles[i].hi = _mm512_load_si512(offset + 8);
        }
        for (int64_t h = 0; h < num_item_heads; ++h) {
            KeyTile<T> head_tiles[kKeyTiles];
            for (int64_t i = 0; i < nk; ++i) {
                head_tiles[i] = tiles[i];
                head_tiles[i].cell0 += h * D * block_size;  // the head's cells within each block
            }
            if (contiguous)
                head_scores_n<Dt, NV, false>(nk, q, h * group, (h + 1) * group, head_tiles, block_size, vscale,
                                             scores + t0, len, &pf);
            else
                head_scores_n<Dt, NV, true>(nk, q, h * group, (h + 1) * group, head_tiles, block_size, vscale,
                                            scores + t0, len, &pf);
        }
        pf.drain();
    }
}

}  // namespace kvflow::decode
#endif
