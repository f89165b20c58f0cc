// Kimi's cut pass (tokenization_kimi.py): the text is cut every 400,000 code points, then each
// chunk is cut wherever a run of Python-`isspace` or of non-`isspace` characters grows past 25,000
// (cuts at run_start + 25,000 * k). Every cut becomes a piece boundary: each part is pre-tokenized
// on its own, so the pattern's look-ahead sees the part's end.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "classes.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace k3tok {

constexpr size_t kChunkChars = 400000;
constexpr size_t kMaxRun = 25000;

inline bool ascii_isspace(uint8_t b) { return (b >= 9 && b <= 13) || (b >= 28 && b <= 32); }

// Byte offset of the code point `count` positions after `from` (or n).
inline size_t advance_code_points(const uint8_t* s, size_t from, size_t n, size_t count) {
  size_t i = from;
#if defined(__SSE2__)
  // 64-byte blocks first (this walks every byte of a text over 400k code points)
  const __m128i limit = _mm_set1_epi8(-64);  // continuation bytes 0x80..0xBF are < -64 as int8
  while (i + 64 <= n) {
    uint64_t cont = 0;
    for (int q = 0; q < 4; ++q) {
      __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16 * q));
      cont |= uint64_t(unsigned(_mm_movemask_epi8(_mm_cmpgt_epi8(limit, v)))) << (16 * q);
    }
    size_t starts = cont ? 64 - size_t(__builtin_popcountll(cont)) : 64;
    if (starts > count) break;
    count -= starts;
    i += 64;
  }
#endif
  // whole words: a word holds 8 minus its continuation bytes (10xxxxxx) code-point starts
  while (i + 8 <= n) {
    uint64_t w;
    std::memcpy(&w, s + i, 8);
    uint64_t cont = w & ~(w << 1) & 0x8080808080808080ull;
    size_t starts = cont ? 8 - size_t(__builtin_popcountll(cont)) : 8;
    if (starts > count) break;
    count -= starts;
    i += 8;
  }
  for (; i < n; ++i) {
    if ((s[i] & 0xC0) == 0x80) continue;  // inside a character
    if (count == 0) break;
    --count;
  }
  return i;
}

// True if every full 8 KiB block of s[a, b) holds an ASCII space/newline and an ASCII non-space
// character: then no run reaches 16 Ki bytes (so fewer than 25,000 code points) and nothing is cut.
inline bool surely_no_long_runs(const uint8_t* s, size_t a, size_t b) {
  constexpr size_t kBlock = 8192;
  for (size_t x = a; x + kBlock <= b; x += kBlock) {
    const uint8_t* blk = s + x;
    if (!std::memchr(blk, ' ', kBlock) && !std::memchr(blk, '\n', kBlock)) return false;
    bool nonspace = false;
    for (size_t k = 0; k < kBlock; ++k) {
      uint8_t c = blk[k];
      if (c > 32 && c < 127) {
        nonspace = true;
        break;
      }
    }
    if (!nonspace) return false;
  }
  return true;
}

#if defined(__SSE2__)
// sp: bit k set if p[k] is ASCII whitespace for Python (9-13, 28-32); high: bytes >= 0x80.
inline void ascii_space_mask(const uint8_t* p, uint64_t& sp, uint64_t& high) {
  const __m128i lo1 = _mm_set1_epi8(9), lo2 = _mm_set1_epi8(28), four = _mm_set1_epi8(4);
  sp = high = 0;
  for (int q = 0; q < 4; ++q) {
    __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * q));
    __m128i d1 = _mm_sub_epi8(v, lo1), d2 = _mm_sub_epi8(v, lo2);
    __m128i in1 = _mm_cmpeq_epi8(_mm_min_epu8(d1, four), d1), in2 = _mm_cmpeq_epi8(_mm_min_epu8(d2, four), d2);
    sp |= uint64_t(unsigned(_mm_movemask_epi8(_mm_or_si128(in1, in2)))) << (16 * q);
    high |= uint64_t(unsigned(_mm_movemask_epi8(v))) << (16 * q);
  }
}
#endif

// Calls emit(start, end) for each part of one 400k chunk s[a, b) (exact transcription of Kimi's
// _split_whitespaces_or_nonwhitespaces).
template <class Emit>
inline void split_runs(const uint8_t* s, size_t a, size_t b, Emit&& emit) {
  if (b - a <= kMaxRun || surely_no_long_runs(s, a, b)) {
    emit(a, b);
    return;
  }
  const CharClasses& C = CharClasses::get();
  size_t slice_start = a, run_len = 0;
  bool cur_space = false;
  size_t slow_until = a + 1;  // per character before this (the first one sets cur_space)
  for (size_t i = a; i < b;) {
#if defined(__SSE2__)
    // 64 ASCII bytes that cannot complete a 25k run: only the run length at their end matters
    // (a text without whitespace, such as digits or base64, spent ~25% of its encode here)
    if (i >= slow_until && i + 64 <= b) {
      uint64_t sp, high;
      ascii_space_mask(s + i, sp, high);
      const uint64_t same = cur_space ? sp : ~sp;  // bytes of the current run's class
      const size_t lead = same == ~uint64_t(0) ? 64 : size_t(__builtin_ctzll(~same));
      if (!high && run_len + lead <= kMaxRun) {
        if (lead == 64) {
          run_len += 64;
        } else {
          cur_space = (sp >> 63) != 0;
          const uint64_t tail = cur_space ? sp : ~sp;
          run_len = tail == ~uint64_t(0) ? 64 : size_t(__builtin_clzll(~tail));
        }
        i += 64;
        continue;
      }
      slow_until = i + 64;
    }
#endif
    uint32_t l;
    bool sp = s[i] < 0x80 ? ascii_isspace(s[i]) : (C.of(decode_utf8(s + i, l)) & kPySpace) != 0;
    if (s[i] < 0x80) l = 1;
    if (i == a) cur_space = sp;
    if (sp != cur_space) {
      run_len = 1;
      cur_space = sp;
    } else if (++run_len > kMaxRun) {
      emit(slice_start, i);
      slice_start = i;
      run_len = 1;
    }
    i += l;
  }
  emit(slice_start, b);
}

template <class Emit>
inline void kimi_cuts(const uint8_t* s, size_t n, Emit&& emit) {
  if (n <= kChunkChars) {  // at most 400k code points: one chunk
    split_runs(s, 0, n, emit);
    return;
  }
  for (size_t a = 0; a < n;) {
    size_t b = advance_code_points(s, a, n, kChunkChars);
    split_runs(s, a, b, emit);
    a = b;
  }
}

}  // namespace k3tok
