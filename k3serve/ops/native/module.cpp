// k3serve.ops.native._kernels: fused fp32 CPU decode kernels (MLA over the paged latent cache, the KDA step).
//
// The one extension module of the ops: each kernel lives beside its op (ops/<op>/native/*.h, included from
// the ops/ directory, which setup.py puts on the include path); the SIMD helpers they share are here.
//
// Tensors arrive as raw addresses with their sizes and row strides; the Python wrappers (ops/mla/cpu.py,
// ops/kda/cpu.py) check dtype, device and layout first and fall back to the torch ops when these do not
// apply. The GIL is released while a kernel runs.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "kda/native/kda_decode.h"
#include "mla/native/mla_decode.h"

namespace py = pybind11;

namespace {

template <class T>
T* ptr(uintptr_t address) { return reinterpret_cast<T*>(address); }

void mla_decode(uintptr_t q, uintptr_t cache, uintptr_t table, uintptr_t lens, uintptr_t out, int64_t B, int64_t H,
                int64_t W, int64_t C, int64_t num_blocks, int64_t bs, int64_t table_stride) {
    const auto* tab = ptr<const int64_t>(table);
    const auto* len = ptr<const int64_t>(lens);
    int64_t longest = 0;
    for (int64_t i = 0; i < B; ++i) {  // a bad table would read outside the cache: refuse it
        if (len[i] < 0 || (len[i] + bs - 1) / bs > table_stride) throw std::out_of_range("context length past the block table");
        for (int64_t j = 0; j < (len[i] + bs - 1) / bs; ++j)
            if (tab[i * table_stride + j] < 0 || tab[i * table_stride + j] >= num_blocks)
                throw std::out_of_range("block table entry outside the cache");
        longest = std::max(longest, len[i]);
    }
    std::vector<float> scores(static_cast<size_t>(H * std::max<int64_t>(longest, 1)));
    for (int64_t i = 0; i < B; ++i)
        k3::mla_decode_seq(ptr<const float>(q) + i * H * W, ptr<const float>(cache), tab + i * table_stride, len[i],
                           H, W, C, bs, scores.data(), ptr<float>(out) + i * H * C);
}

void kda_decode(uintptr_t x, uintptr_t conv_w, uintptr_t conv, uintptr_t f, uintptr_t dt_bias, uintptr_t a_log,
                uintptr_t b, uintptr_t state, uintptr_t out, int64_t N, int64_t H, int64_t K, int64_t V, int64_t Wc,
                int64_t sx, int64_t sf, int64_t sb, float scale, float l2_eps, bool k3_gate, float lower_bound) {
    if (K > 256 || V > 256 || Wc < 1) throw std::invalid_argument("kda_decode: head dims must be <= 256");
    const k3::KdaDims d{N, H, K, V, Wc, sx, sf, sb, scale, l2_eps, lower_bound, k3_gate};
    const int64_t channels = 2 * H * K + H * V;
    std::vector<float> y(static_cast<size_t>(channels));
    for (int64_t n = 0; n < N; ++n)
        k3::kda_decode_seq(d, ptr<const float>(x) + n * sx, ptr<const float>(conv_w),
                           ptr<float>(conv) + n * channels * (Wc - 1), ptr<const float>(f) + n * sf,
                           ptr<const float>(dt_bias), ptr<const float>(a_log), ptr<const float>(b) + n * sb,
                           ptr<float>(state) + n * H * K * V, ptr<float>(out) + n * H * V, y.data());
}

}  // namespace

PYBIND11_MODULE(_kernels, m) {
    m.doc() = "fused fp32 CPU decode kernels (raw pointers; use the checked wrappers in k3serve.ops)";
    m.def("mla_decode", &mla_decode, py::call_guard<py::gil_scoped_release>());
    m.def("kda_decode", &kda_decode, py::call_guard<py::gil_scoped_release>());
}
