// Hand-written scanner for the Kimi pre-tokenizer pattern (no regex engine).
//
// The pattern's alternatives, tried in this order at every position (leftmost-first, as tiktoken's
// fancy-regex does); U/W are the upper/lower letter sets with Han removed, P = [^\r\n\p{L}\p{N}]:
//   A1 [\p{Han}]+
//   A2 P? U* W+ contraction?          A3 P? U+ W* contraction?
//   A4 \p{N}{1,3}                     A5 ' '? [^\s\p{L}\p{N}]+ [\r\n]*
//   A6 \s*[\r\n]+                     A7 \s+(?!\S)                 A8 \s+
// Backtracking is reproduced exactly: A2 may give back U* characters (only one that is also in W
// can end W+), the optional prefix is retried without, A6 ends after the last \r or \n of the
// whitespace run, A7 gives back the run's last character unless the run reaches the end.
#pragma once
#include <cstddef>
#include <cstdint>

#include "classes.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace k3tok {

class Scanner {
 public:
  Scanner(const uint8_t* s, size_t n) : C_(CharClasses::get()), s_(s), n_(n) {}

  // End of the piece that starts at i (i < n).
  size_t next(size_t i) const {
    if (s_[i] < 0x80) {
      size_t e = next_ascii(i);
      if (e) return e;
    }
    return next_generic(i);
  }

 private:
  static bool lower(uint8_t b) { return uint8_t(b - 'a') < 26; }
  static bool upper(uint8_t b) { return uint8_t(b - 'A') < 26; }

  // End of the run of a-z starting at e.
  size_t lower_run(size_t e) const {
#if defined(__SSE2__)
    const __m128i a = _mm_set1_epi8('a'), lim = _mm_set1_epi8('z' - 'a');
    while (e + 16 <= n_) {
      __m128i off = _mm_sub_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s_ + e)), a);
      unsigned out = ~unsigned(_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_min_epu8(off, lim), off))) & 0xFFFF;
      if (out) return e + unsigned(__builtin_ctz(out));
      e += 16;
    }
#endif
    while (e < n_ && lower(s_[e])) ++e;
    return e;
  }

  // The common all-ASCII pieces, decided without the general alternation; 0 = not decided here
  // (a non-ASCII character is next to the piece, or a whitespace run): use next_generic.
  size_t next_ascii(size_t i) const {
    const uint8_t b = s_[i];
    size_t j = i;  // where the letters start
    if (!lower(b) && !upper(b)) {
      if (b - '0' < 10u) {  // \p{N}{1,3}
        size_t e = i + 1;
        while (e < n_ && e < i + 3 && s_[e] - '0' < 10u) ++e;
        return (e < n_ && e < i + 3 && s_[e] >= 0x80) ? 0 : e;
      }
      if (i + 1 >= n_) return 0;
      const uint8_t c1 = s_[i + 1];
      if (c1 >= 0x80) return 0;
      const uint16_t f0 = C_.ascii(b);
      if ((f0 & kPrefix) && (lower(c1) || upper(c1))) {
        j = i + 1;  // P? then letters
      } else {
        size_t e;
        if (b == ' ' && (C_.ascii(c1) & kPunct))
          e = i + 2;
        else if (f0 & kPunct)
          e = i + 1;
        else
          return ascii_whitespace(i);
        while (e < n_ && s_[e] < 0x80 && (C_.ascii(s_[e]) & kPunct)) ++e;
        if (e < n_ && s_[e] >= 0x80) return 0;
        while (e < n_ && (s_[e] == '\r' || s_[e] == '\n')) ++e;
        return e;
      }
    }
    size_t k = j;
    while (k < n_ && upper(s_[k])) ++k;
    if (k < n_ && s_[k] >= 0x80) return 0;
    if (k < n_ && lower(s_[k])) {  // U* W+
      size_t e = lower_run(k + 1);
      if (e < n_ && s_[e] >= 0x80) return 0;
      return contraction(e);
    }
    return contraction(k);  // U+ and no W: the third alternative
  }

  // A6 / A7 / A8 over a run of ASCII whitespace (0 if a non-ASCII character follows it).
  size_t ascii_whitespace(size_t i) const {
    size_t e = i, after_last_nl = 0;
    for (; e < n_; ++e) {
      uint8_t c = s_[e];
      if (c != ' ' && uint8_t(c - 9) > 4) break;
      if (c == '\r' || c == '\n') after_last_nl = e + 1;
    }
    if (e < n_ && s_[e] >= 0x80) return 0;
    if (after_last_nl) return after_last_nl;
    if (e == n_ || e - i == 1) return e;
    return e - 1;
  }

  size_t next_generic(size_t i) const {
    uint32_t l0;
    uint16_t f0 = at(i, l0);
    if (f0 & kHan) return run(i + l0, kHan);
    if (f0 & (kUpper | kLower | kPrefix)) {
      size_t e = letters(i, f0, l0);
      if (e) return e;
    }
    if (f0 & kNumber) {
      size_t e = i + l0;
      for (int k = 0; k < 2 && e < n_; ++k) {
        uint32_t l;
        if (!(at(e, l) & kNumber)) break;
        e += l;
      }
      return e;
    }
    if (s_[i] == ' ' && i + 1 < n_) {
      uint32_t l;
      if (at(i + 1, l) & kPunct) return punct_tail(i + 1 + l);
    }
    if (f0 & kPunct) return punct_tail(i + l0);
    size_t e = whitespace(i);
    return e > i ? e : i + l0;
  }

  uint16_t at(size_t i, uint32_t& len) const { return class_at(C_, s_ + i, len); }

  size_t run(size_t k, uint16_t mask) const {
    while (k < n_) {
      uint32_t l;
      if (!(at(k, l) & mask)) break;
      k += l;
    }
    return k;
  }

  // A2 then A3, each first with the optional prefix character, then without it.
  size_t letters(size_t i, uint16_t f0, uint32_t l0) const {
    bool pre = (f0 & kPrefix) && i + l0 < n_;
    uint16_t f1 = 0;
    if (pre) {
      uint32_t l1;
      f1 = at(i + l0, l1);
      pre = (f1 & (kUpper | kLower)) != 0;
    }
    if (pre) {
      size_t e = upper_star_lower_plus(i + l0);
      if (e) return e;
    }
    if (f0 & (kUpper | kLower)) {
      size_t e = upper_star_lower_plus(i);
      if (e) return e;
    }
    if (pre && (f1 & kUpper)) return contraction(run(run(i + l0, kUpper), kLower));
    if (f0 & kUpper) return contraction(run(run(i, kUpper), kLower));
    return 0;
  }

  // U* W+ from j, or 0. U* is greedy; on backtracking W+ can only start at the last U character
  // that is also in W (Lm, Lo, M), and then ends right after it.
  size_t upper_star_lower_plus(size_t j) const {
    {  // ASCII fast path: [A-Z]*[a-z]+ (ASCII capitals are never in W, a-z are W only)
      size_t k = j;
      while (k < n_ && uint8_t(s_[k] - 'A') < 26) ++k;
      if (k < n_ && uint8_t(s_[k] - 'a') < 26) {
        size_t e = k + 1;
        while (e < n_ && uint8_t(s_[e] - 'a') < 26) ++e;
        if (e < n_ && s_[e] >= 0x80) e = run(e, kLower);
        return contraction(e);
      }
      if (k >= n_ || s_[k] < 0x80) return 0;
    }
    size_t k = j, last_both = SIZE_MAX;
    uint32_t l = 0, l_both = 0;
    uint16_t f = 0;
    while (k < n_) {
      f = at(k, l);
      if (!(f & kUpper)) break;
      if (f & kLower) {
        last_both = k;
        l_both = l;
      }
      k += l;
    }
    size_t e;
    if (k < n_ && (f & kLower))
      e = run(k + l, kLower);
    else if (last_both != SIZE_MAX)
      e = last_both + l_both;
    else
      return 0;
    return contraction(e);
  }

  // (?i:'s|'t|'re|'ve|'m|'ll|'d)? ; U+017F (long s) case-folds to 's'.
  size_t contraction(size_t e) const {
    if (e + 1 >= n_ || s_[e] != '\'') return e;
    uint8_t c = s_[e + 1] | 0x20;
    if (c == 's' || c == 't' || c == 'm' || c == 'd') return e + 2;
    if (e + 2 < n_) {
      uint8_t c2 = s_[e + 2] | 0x20;
      if ((c == 'r' || c == 'v') && c2 == 'e') return e + 3;
      if (c == 'l' && c2 == 'l') return e + 3;
      if (s_[e + 1] == 0xC5 && s_[e + 2] == 0xBF) return e + 3;
    }
    return e;
  }

  size_t punct_tail(size_t e) const {
    e = run(e, kPunct);
    while (e < n_ && (s_[e] == '\r' || s_[e] == '\n')) ++e;
    return e;
  }

  // A6 / A7 / A8 over the maximal \s run starting at i.
  size_t whitespace(size_t i) const {
    size_t e = i, after_last_nl = 0, last_start = i;
    while (e < n_) {
      uint32_t l;
      if (!(at(e, l) & kWs)) break;
      if (s_[e] == '\r' || s_[e] == '\n') after_last_nl = e + 1;
      last_start = e;
      e += l;
    }
    if (after_last_nl) return after_last_nl;
    if (e == n_) return e;
    if (last_start > i) return last_start;
    return e;
  }

  const CharClasses& C_;
  const uint8_t* s_;
  size_t n_;
};

template <class Emit>
inline void pretokenize(const uint8_t* s, size_t n, Emit&& emit) {
  Scanner sc(s, n);
  size_t i = 0;
  while (i < n) {
    size_t e = sc.next(i);
    emit(i, e);
    i = e;
  }
}

}  // namespace k3tok
