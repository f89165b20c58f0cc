// Absorbed MLA decode over the paged latent cache, one pass per sequence, reading the cache in place.
//
// q      [B, H, W]          fp32, absorbed query with the softmax scale folded in (W = C + R)
// cache  [blocks, bs, W]    fp32 latents [c (C) | k_rot (R)]
// table  [B, table_stride]  int64 cache blocks per sequence
// lens   [B]                int64 context lengths
// out    [B, H, C]          softmax_t(q_h · latent_t) · c_t
// scratch                   H * max(lens) floats (the scores of one sequence)
//
// Per sequence: scores of all heads against each cached row, an exact softmax over each head's scores, then the
// weighted sum of the first C columns of the rows, which are still in L2 from the first pass: the latents
// cross memory once and nothing is gathered or padded. Heads go in groups of up to 4 so that a loaded row
// (scores) or column slice (values) serves all of them from registers.
#pragma once

#include <algorithm>
#include <cstdint>

#include "native/simd.h"

namespace k3 {

// out[h] = q_h · row for NH heads (q rows W apart); the same summation order as dot().
template <int NH>
inline void head_dots(const float* __restrict q, const float* __restrict row, int64_t W, float* out) {
    v8 lo[NH] = {}, hi[NH] = {};
    int64_t w = 0;
    for (; w + 16 <= W; w += 16) {
        const v8 r0 = load8(row + w), r1 = load8(row + w + 8);
        for (int h = 0; h < NH; ++h) {
            lo[h] += load8(q + h * W + w) * r0;
            hi[h] += load8(q + h * W + w + 8) * r1;
        }
    }
    const bool eight = w + 8 <= W;
    if (eight) {
        const v8 r0 = load8(row + w);
        for (int h = 0; h < NH; ++h) lo[h] += load8(q + h * W + w) * r0;
    }
    for (int h = 0; h < NH; ++h) {
        float s = hsum8(lo[h] + hi[h]);
        for (int64_t i = w + (eight ? 8 : 0); i < W; ++i) s += q[h * W + i] * row[i];
        out[h] = s;
    }
}

// Calls fn(t, row) for the sequence's rows in order. With `prefetch`, each block first requests the next one:
// blocks are scattered, so the hardware prefetcher loses the stream at every block boundary.
template <class Fn>
inline void for_rows(const float* cache, const int64_t* table, int64_t len, int64_t bs, int64_t W, Fn fn,
                     bool prefetch = false) {
    for (int64_t t0 = 0; t0 < len; t0 += bs) {
        const float* block = cache + table[t0 / bs] * bs * W;
        const int64_t n = std::min(bs, len - t0);
        if (prefetch && t0 + bs < len) {
            const char* next = reinterpret_cast<const char*>(cache + table[t0 / bs + 1] * bs * W);
            const int64_t bytes = std::min(bs, len - t0 - bs) * W * static_cast<int64_t>(sizeof(float));
            for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(next + off);
        }
        for (int64_t i = 0; i < n; ++i) fn(t0 + i, block + i * W);
    }
}

// out[h, c0 : c0 + 8·NV] = Σ_t p[h, t] row_t[c0 : ...] for NH heads, accumulated in registers (t in order).
template <int NH, int NV>
inline void head_values(const float* cache, const int64_t* table, int64_t len, int64_t bs, int64_t W,
                        const float* __restrict p, int64_t c0, float* __restrict out, int64_t C) {
    v8 acc[NH][NV] = {};
    for_rows(cache, table, len, bs, W, [&](int64_t t, const float* row) {
        v8 r[NV];
        for (int j = 0; j < NV; ++j) r[j] = load8(row + c0 + 8 * j);
        for (int h = 0; h < NH; ++h) {
            const float ph = p[h * len + t];
            for (int j = 0; j < NV; ++j) acc[h][j] += ph * r[j];
        }
    });
    for (int h = 0; h < NH; ++h)
        for (int j = 0; j < NV; ++j) store8(out + h * C + c0 + 8 * j, acc[h][j]);
}

template <int NH>
inline void head_group(const float* q, const float* cache, const int64_t* table, int64_t len, int64_t W,
                       int64_t C, int64_t bs, float* scores, float* out) {
    // pass 1: scores[h, t]
    for_rows(cache, table, len, bs, W, [&](int64_t t, const float* row) {
        float s[NH];
        head_dots<NH>(q, row, W, s);
        for (int h = 0; h < NH; ++h) scores[h * len + t] = s[h];
    }, /*prefetch=*/true);
    // exact softmax numerators per head; the 1 / sum is applied to the output
    float inv[NH];
    for (int h = 0; h < NH; ++h) {
        float* s = scores + h * len;
        float m = s[0];
        int64_t t = 0;
        if (len >= 8) {
            v8 mv = load8(s);
            for (t = 8; t + 8 <= len; t += 8) {
                const v8 x = load8(s + t);
                mv = x > mv ? x : mv;
            }
            for (int l = 0; l < 8; ++l) m = std::max(m, mv[l]);
        }
        for (; t < len; ++t) m = std::max(m, s[t]);
        v8 sv = {};
        for (t = 0; t + 8 <= len; t += 8) {
            const v8 e = exp8_nonpos(load8(s + t) - m);
            store8(s + t, e);
            sv += e;
        }
        float sum = hsum8(sv);
        for (; t < len; ++t) {
            s[t] = exp_nonpos(s[t] - m);
            sum += s[t];
        }
        inv[h] = 1.0f / sum;
    }
    // pass 2: out[h] = Σ_t p[h, t] c_t, 16 columns at a time (then 8, then single columns)
    int64_t c0 = 0;
    for (; c0 + 16 <= C; c0 += 16) head_values<NH, 2>(cache, table, len, bs, W, scores, c0, out, C);
    if (c0 + 8 <= C) {
        head_values<NH, 1>(cache, table, len, bs, W, scores, c0, out, C);
        c0 += 8;
    }
    for (; c0 < C; ++c0)
        for (int h = 0; h < NH; ++h) {
            float acc = 0.0f;
            for_rows(cache, table, len, bs, W, [&](int64_t t, const float* row) { acc += scores[h * len + t] * row[c0]; });
            out[h * C + c0] = acc;
        }
    for (int h = 0; h < NH; ++h)
        for (int64_t c = 0; c < C; ++c) out[h * C + c] *= inv[h];
}

K3_KERNEL
void mla_decode_seq(const float* __restrict q, const float* __restrict cache, const int64_t* table, int64_t len,
                    int64_t H, int64_t W, int64_t C, int64_t bs, float* __restrict scores, float* __restrict out) {
    if (len <= 0) {
        std::fill(out, out + H * C, 0.0f);
        return;
    }
    for (int64_t h0 = 0; h0 < H; h0 += 4) {
        const float* qh = q + h0 * W;
        float* oh = out + h0 * C;
        switch (std::min<int64_t>(4, H - h0)) {
            case 4: head_group<4>(qh, cache, table, len, W, C, bs, scores, oh); break;
            case 3: head_group<3>(qh, cache, table, len, W, C, bs, scores, oh); break;
            case 2: head_group<2>(qh, cache, table, len, W, C, bs, scores, oh); break;
            default: head_group<1>(qh, cache, table, len, W, C, bs, scores, oh); break;
        }
    }
}

}  // namespace k3
