// The whole KDA decode step of a batch (one token per sequence), from the projected q|k|v to the attention
// output, in one pass per sequence; conv state and recurrent state are updated in place.
//
// x      [N, 2HK + HV]   row stride sx: pre-conv q|k|v (the fused projection's output)
// conv_w [2HK + HV, Wc]  depthwise filters, conv_w[c, Wc-1] multiplies the current token
// conv   [N, 2HK + HV, Wc-1]  last Wc-1 pre-conv inputs (in place)
// f      [N, H, K]       row stride sf: gate projection;  dt_bias [H, K], a_log [H]
// b      [N, H]          row stride sb: beta logits
// state  [N, H, K, V]    fp32 (in place);  out [N, H, V]
// Per sequence: y = SiLU(short conv(x)); q, k L2-normalised per head; g = -exp(a_log) softplus(f + dt_bias)
// (Kimi-Linear) or lower_bound sigmoid(exp(a_log) (f + dt_bias)) (K3); beta = sigmoid(b); then
//   S <- Diag(exp(g)) S;  S <- S + k (beta (v - Sᵀk))ᵀ;  o = Sᵀ (scale q)
// in two passes over each head's [K, V] state, which stays in L1 between them.
#pragma once

#include <cmath>
#include <cstdint>

#include "native/simd.h"

namespace k3 {

struct KdaDims {
    int64_t N, H, K, V, Wc, sx, sf, sb;
    float scale, l2_eps, lower_bound;
    bool k3_gate;  // lower_bound sigmoid form (K3) instead of -softplus (Kimi-Linear)
};

K3_KERNEL
void kda_decode_seq(const KdaDims& d, const float* __restrict x, const float* __restrict conv_w,
                    float* __restrict conv, const float* __restrict f, const float* __restrict dt_bias,
                    const float* __restrict a_log, const float* __restrict b, float* __restrict state,
                    float* __restrict out, float* __restrict y) {
    const int64_t H = d.H, K = d.K, V = d.V, Wc = d.Wc, hist = Wc - 1;
    const int64_t channels = 2 * H * K + H * V;
    // short conv over all channels; the state shifts by one and takes the new input
    for (int64_t c = 0; c < channels; ++c) {
        const float* w = conv_w + c * Wc;
        float* st = conv + c * hist;
        float acc = hist ? st[0] * w[0] : 0.0f;
        for (int64_t j = 1; j < hist; ++j) acc += st[j] * w[j];
        acc += x[c] * w[hist];
        for (int64_t j = 0; j + 1 < hist; ++j) st[j] = st[j + 1];
        if (hist) st[hist - 1] = x[c];
        y[c] = acc;
    }
    int64_t c = 0;  // SiLU: y / (1 + exp(-y))
    for (; c + 8 <= channels; c += 8) store8(y + c, load8(y + c) / (1.0f + exp8(-load8(y + c))));
    for (; c < channels; ++c) y[c] = y[c] / (1.0f + exp_any(-y[c]));
    float decay[256], u[256];  // K, V <= 256 (checked by the caller)
    for (int64_t h = 0; h < H; ++h) {
        float* q = y + h * K;
        float* k = y + H * K + h * K;
        const float* v = y + 2 * H * K + h * V;
        const float qn = d.scale / std::sqrt(dot(q, q, K) + d.l2_eps);
        const float kn = 1.0f / std::sqrt(dot(k, k, K) + d.l2_eps);
        const float rate = std::exp(a_log[h]);
        const float* fh = f + h * K;
        const float* bias = dt_bias + h * K;
        int64_t i = 0;
        for (; i + 8 <= K; i += 8) {  // log decay g, then exp(g); q scaled, k unit-norm
            v8 z = load8(fh + i) + load8(bias + i);
            v8 g;
            if (d.k3_gate) {
                g = d.lower_bound / (1.0f + exp8(-(rate * z)));
            } else {  // softplus with torch's threshold: z above 20 passes through
                v8 sp = (z > 0.0f ? z : 0.0f) + log1p8_nonneg(exp8_nonpos(z < 0.0f ? z : -z));
                g = -rate * (z > 20.0f ? z : sp);
            }
            store8(decay + i, exp8_nonpos(g));
            store8(q + i, load8(q + i) * qn);
            store8(k + i, load8(k + i) * kn);
        }
        for (; i < K; ++i) {
            const float z = fh[i] + bias[i];
            const float g = d.k3_gate ? d.lower_bound * sigmoid(rate * z)
                                      : -rate * (z > 20.0f ? z : std::log1p(std::exp(z)));
            decay[i] = exp_nonpos(g);
            q[i] *= qn;
            k[i] *= kn;
        }
        const float beta = sigmoid(b[h]);
        float* S = state + h * K * V;
        // pass 1: decay the rows and take u = Sᵀk
        for (int64_t j = 0; j < V; ++j) u[j] = 0.0f;
        for (int64_t i = 0; i < K; ++i) {
            float* __restrict row = S + i * V;
            const float di = decay[i], ki = k[i];
            for (int64_t j = 0; j < V; ++j) {
                row[j] *= di;
                u[j] += ki * row[j];
            }
        }
        for (int64_t j = 0; j < V; ++j) u[j] = beta * (v[j] - u[j]);  // delta
        // pass 2: rank-1 update and o = Sᵀ(scale q)
        float* __restrict o = out + h * V;
        for (int64_t j = 0; j < V; ++j) o[j] = 0.0f;
        for (int64_t i = 0; i < K; ++i) {
            float* __restrict row = S + i * V;
            const float ki = k[i], qi = q[i];
            for (int64_t j = 0; j < V; ++j) {
                row[j] += ki * u[j];
                o[j] += qi * row[j];
            }
        }
    }
}

}  // namespace k3
