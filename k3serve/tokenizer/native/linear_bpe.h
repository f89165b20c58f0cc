// Linear-time BPE for long pieces: a backtracking encoder over the vocabulary.
//
// Greedily take the longest token that prefixes the rest of the piece; accept it only if BPE could
// have produced it next to the previous token (`valid_pair`), else try its next shorter prefix
// token; if none fits, mark the position unreachable and back up one token. `valid_pair` replays
// the merges that built both tokens and rejects the pair if BPE would have merged across the
// boundary first. The idea is the backtracking encoder of GitHub's `bpe` crate (rust-gems); this is
// an independent implementation. It equals tiktoken's merge order when every token's bytes encode
// to that token, which `build` checks for the whole vocabulary (else the encoder stays off and the
// heap merge is used); the tests compare it with tiktoken on long pieces.
//
// Layout, for random text (where every step can miss a cache): one walk of the prefix trie
// (prefix_trie.h) lists every candidate at a position with its length; `valid_pair` touches only
// the 8-byte split records, a 256 KiB filter, the merge table (a pair and its result packed in 8
// bytes, 2 MiB for Kimi) and, for two byte tokens, a direct table. The tables sit on huge pages.
// The walk from the end of the likeliest next token runs before that token is validated, so their
// cache misses overlap.
//
// Shortcuts that keep the result (all measured on the 100k random a-z piece, where a check
// pair-looked-up ~2.7 times per candidate before):
//  * the walk at a token's start saw every token that merges it with a following one (each is a
//    longer candidate there), so its `Hint` answers the pair lookups while the token is whole;
//  * pairs of one- and two-byte tokens (3/4 of the checks) go through SmallPairs::valid_short,
//    which knows their splits from the bytes and needs no split record; pairs with a three-byte
//    token (most of the rest) through SmallPairs::valid, which reads their splits and their merges
//    into three bytes from the bytes too (small_pairs.h; 100k piece ~0.93x time);
//  * a back-up reuses the candidate list of the token before instead of walking again (not in
//    encode_varied, where the list's upkeep cost more than the walks it saved);
//  * a two- or three-byte candidate that no token could follow (`dead_end`, from the ranks of the
//    candidates after it) is skipped before it is taken, as the back-up from there would have
//    done: 4/5 of the back-ups on random letters (100k piece ~0.88x time). Only in a second copy of
//    the loop (encode_varied), taken for varied ASCII, so that other pieces run the plain loop.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "prefix_trie.h"
#include "small_pairs.h"
#include "vocab.h"

namespace k3tok {

class LinearBpe {
 public:
  // Returns false (and leaves the encoder disabled) if the vocabulary fails the self-check.
  bool build(const Vocab& V) {
    V_ = &V;
    const size_t n = V.size();
    if (n >= kMaxTokens) return false;  // the merge table packs ids in 21 bits
    trie_.build(V);
    std::vector<Cand> cand(V.max_token_len() + 1);
    std::vector<uint32_t> next_prefix(n, kNone);  // longest token that is a proper prefix
    for (uint32_t id = 0; id < n; ++id)
      if (V.has(id) && V.len(id) > 1) {
        size_t k = trie_.walk(V.bytes(id), V.len(id) - 1, cand.data());
        next_prefix[id] = cand[k - 1].tok;
      }
    size_t cap = 16;
    while (cap < n + n / 2) cap <<= 1;  // load factor <= 2/3
    pairs_.assign(cap, kEmpty);
    pmask_ = cap - 1;
    filter_.assign(kFilterMask + 1, 0);
    split_.assign(n, Split{kNone, kNone});
    for (uint32_t id = 0; id < n; ++id) {
      if (!V.has(id)) continue;
      split_[id] = Split{id, id};
      for (uint32_t a = next_prefix[id]; a != kNone; a = next_prefix[a]) {
        const uint8_t* rest = V.bytes(id) + V.len(a);
        uint32_t b = V.find(rest, V.len(id) - V.len(a), rest + V.len(id) - V.len(a) + 8);
        if (b != kNone && a < id && b < id && valid_pair(tables(), a, b)) {
          split_[id] = Split{a, b};
          insert_pair(a, b, id);
          break;
        }
      }
    }
    // merges of two byte tokens (ranks 0..255 in tiktoken vocabularies): a direct table
    bytes_low_ = true;
    for (int c = 0; c < 256; ++c) bytes_low_ = bytes_low_ && trie_.byte_tok(uint8_t(c)) < 256;
    pair2_.assign(size_t(1) << 16, kNone);
    if (bytes_low_) {
      const Tables T = tables();
      for (uint32_t x = 0; x < 256; ++x)
        for (uint32_t y = 0; y < 256; ++y) pair2_[(x << 8) | y] = pair_lookup_hashed(T, x, y);
    }
    small_.build(V, trie_, [&](uint32_t id) { return std::make_pair(split_[id].a, split_[id].b); });
    // dead_end reads y z from pair2 by bytes and two-byte tokens' splits from their bytes
    // (valid_short's conditions); three-byte tokens' from the bytes too where SmallPairs::ok
    skip_lens_ = bytes_low_ && small_.short_ok() ? (small_.ok() ? 2 : 1) : 0;
    std::vector<uint32_t> out;
    for (uint32_t id = 0; id < n; ++id) {
      if (!V.has(id)) continue;
      out.clear();
      if (!encode(V.bytes(id), V.len(id), out) || out.size() != 1 || out[0] != id) return false;
    }
    ok_ = true;
    return true;
  }

  bool ok() const { return ok_; }

  // Appends the tokens of p[0, n); returns false (appending nothing) if it cannot.
  bool encode(const uint8_t* p, size_t n, std::vector<uint32_t>& out) const {
    if (!n) return true;
    // The dead-end skip (dead_end) only in a separate copy of the loop, for pieces that look like
    // varied ASCII (random letters, identifiers): elsewhere it hardly ever fires (in runs of one
    // byte never), and even unused its code in the loop cost runs of Han ~5% and a x 100k ~4%.
    // (with skip_lens_ 1, three-byte tokens whose splits SmallPairs cannot read from the bytes, the
    // plain loop: such vocabularies hardly pass build's check, and so that path stays untested)
    if (skip_lens_ == 2 && varied_ascii(p, n)) return encode_varied(p, n, out);
    return encode_loop(p, n, out);
  }

 private:
  // encode_loop with the dead-end skip, in a simpler form: a back-up walks again (no list is kept
  // from the token before). Fewer values live across the loop, so fewer are spilled to the stack
  // (a third of the instructions on random letters were spill traffic; with the rare pair checks
  // out of line, 100k random a-z: 18.5M -> 15.3M instructions).
  // Needs small_.ok() (skip_lens_ 2): checks and splits of three-byte tokens from the bytes.
  bool encode_varied(const uint8_t* p, size_t n, std::vector<uint32_t>& out) const {
    const size_t base = out.size();
    out.resize(base + n);  // at most one token per byte; trimmed at the end
    uint32_t* const o = out.data() + base;
    // reach[e] == 0: no token can end at e (a byte per position: fewer instructions than
    // encode_loop's bits; there the memset cost runs of one byte more than it saved)
    std::unique_ptr<uint8_t[]> reach_v(new uint8_t[n + 1]);
    uint8_t* const reach = reach_v.get();
    std::memset(reach, 1, n + 1);
    std::vector<Cand> cand_v(V_->max_token_len() + 1), next_v(V_->max_token_len() + 1);
    Cand* cand = cand_v.data();  // the candidates at pos (nall of them)
    Cand* next = next_v.data();  // the walk at `at` (nnext of them)
    std::unique_ptr<Taken[]> taken_v(new Taken[n]);  // one array for both: a pointer fewer
    Taken* const tk = taken_v.get();
    const Tables T = tables();
    constexpr uint32_t skip_lens = 2;
    size_t k = 0, pos = 0, at = n, nnext = 0;
    size_t nall = trie_.walk(p, n, cand), nc = nall;  // cand[0, nc) are still to try
    // the last token, its length and hint, carried in locals: read back from o and tk, the hint
    // (stored as two halves) missed store forwarding on every token
    uint32_t last = kNone, la = 0;
    uint32_t partner = kUnknown, merged = kNone;  // its hint, as scalars (see above)
    for (;;) {
      const Hint hint{partner, merged};
      // the longest candidate usually fits: walk from its end now (see the header comment)
      at = nc ? pos + cand[nc - 1].len : n;
      nnext = at < n ? trie_.walk(p + at, n - at, next) : 0;
      while (nc) {
        const Cand c = cand[--nc];
        const size_t e = pos + c.len;
        // a dead end is no part of any encoding, whatever comes before it: skipped before the
        // (costlier) pair check, and reach[e] can stay (a token that fits there is not c)
        if (c.len - 2 < skip_lens && e < n && dead_end_at(T, c, p + pos, e, n, at, nnext, next)) continue;
        if (reach[e] && (last == kNone || valid_next<true, true>(T, last, la, hint, c.tok, c.len, p + pos))) {
          const Hint h = hint_after<true>(T, c.tok, c.len, p + pos, cand + nc + 1, cand + nall);
          partner = h.partner;
          merged = h.merged;
          last = c.tok;
          la = c.len;
          tk[k].len = la;
          tk[k].hint.partner = partner;
          tk[k].hint.merged = merged;
          o[k++] = last;
          pos = e;
          goto taken;
        }
      }
      if (last == kNone) {
        out.resize(base);
        return false;
      }
      reach[pos] = 0;  // back up one token; retry its position with the tokens shorter than it
      --k;
      pos -= tk[k].len;
      last = k ? o[k - 1] : kNone;
      la = k ? tk[k - 1].len : 0;
      partner = k ? tk[k - 1].hint.partner : kUnknown;
      merged = k ? tk[k - 1].hint.merged : kNone;
      nc = nall = trie_.walk(p + pos, n - pos, cand);
      while (nc && cand[nc - 1].len >= tk[k].len) --nc;
      continue;
    taken:
      if (pos == n) break;
      if (pos == at) {
        std::swap(cand, next);
        nc = nall = nnext;
      } else {
        nc = nall = trie_.walk(p + pos, n - pos, cand);
      }
    }
    out.resize(base + k);
    return true;
  }

  bool encode_loop(const uint8_t* p, size_t n, std::vector<uint32_t>& out) const {
    const size_t base = out.size();
    out.resize(base + n);  // at most one token per byte; trimmed at the end
    uint32_t* const o = out.data() + base;
    size_t k = 0;  // tokens so far
    std::vector<uint64_t> reach_v(n / 64 + 1, ~uint64_t(0));  // bit e clear: no token can end at e
    uint64_t* const reach = reach_v.data();
    // candidates at pos, shortest first: the prefix tokens the trie walk passed
    std::vector<Cand> cand_v(V_->max_token_len() + 1);
    std::vector<Cand> next_v(V_->max_token_len() + 1);
    std::vector<Cand> prev_v(V_->max_token_len() + 1);
    Cand* cand = cand_v.data();
    Cand* next = next_v.data();  // the candidates at the end of the token being taken, if walked
    Cand* prev = prev_v.data();  // the candidates at the last token's start (if nprev), for a back-up
    size_t nprev = 0;
    std::unique_ptr<uint32_t[]> lens_v(new uint32_t[n]);  // byte length of each token in o
    uint32_t* const lens = lens_v.get();
    std::unique_ptr<Hint[]> hints_v(new Hint[n]);  // what the walk at each token's start knew
    Hint* const hints = hints_v.get();
    const Tables T = tables();
    size_t nall = trie_.walk(p, n, cand);  // candidates at pos (those >= nc were tried already)
    size_t nc = nall;
    size_t pos = 0;
    for (;;) {
      const uint32_t last = k ? o[k - 1] : kNone;
      const Hint hint = k ? hints[k - 1] : Hint{kUnknown, kNone};
      // the longest candidate usually fits: walk from its end now (see the header comment)
      size_t at = nc ? pos + cand[nc - 1].len : n;  // next holds the walk at `at` (nnext of them)
      size_t nnext = at < n ? trie_.walk(p + at, n - at, next) : 0;
      while (nc) {
        const Cand c = cand[--nc];
        const size_t e = pos + c.len;
        if (((reach[e >> 6] >> (e & 63)) & 1) &&
            (last == kNone || valid_next<false, false>(T, last, lens[k - 1], hint, c.tok, c.len, p + pos))) {
          lens[k] = c.len;
          hints[k] = hint_after<false>(T, c.tok, c.len, p + pos, cand + nc + 1, cand + nall);
          o[k++] = c.tok;
          pos = e;
          goto taken;
        }
      }
      if (last == kNone) {  // nothing fits at the start: not encodable this way
        out.resize(base);
        return false;
      }
      // back up one token; retry its position with the tokens shorter than it
      reach[pos >> 6] &= ~(uint64_t(1) << (pos & 63));
      --k;
      {
        const uint32_t len = lens[k];
        pos -= len;
        if (nprev) {  // the list at the last token's start: no walk
          std::swap(cand, prev);
          nc = nall = nprev;
          nprev = 0;
        } else {
          nc = nall = trie_.walk(p + pos, n - pos, cand);
        }
        while (nc && cand[nc - 1].len >= len) --nc;
      }
      continue;
    taken:
      if (pos == n) break;
      std::swap(prev, cand);
      nprev = nall;
      if (pos == at) {  // at < n here
        std::swap(cand, next);
        nc = nall = nnext;
      } else {
        nc = nall = trie_.walk(p + pos, n - pos, cand);
      }
    }
    out.resize(base + k);
    return true;
  }

  using Cand = PrefixTrie::Cand;
  struct Split {  // the pair BPE merges into this token (a == b == id: a base token)
    uint32_t a, b;
  };
  // The merge of a token with a token right after it, as far as the walk at its start saw: every
  // token that merges a with a following token is a longer candidate there. partner == kNone: a
  // merges with nothing that can follow; kUnknown: more than one partner (look pairs up instead).
  static constexpr uint32_t kUnknown = kNone - 1;
  struct Hint {
    uint32_t partner, merged;
  };
  struct Taken {  // a token taken: its length, and its hint
    uint32_t len;
    Hint hint;
  };
  static constexpr size_t kIdBits = 21;
  static constexpr uint64_t kIdMask = (uint64_t(1) << kIdBits) - 1;
  static constexpr size_t kMaxTokens = kIdMask;  // all-ones is the empty slot
  static constexpr uint64_t kEmpty = ~uint64_t(0);

  static uint64_t pair_key(uint32_t a, uint32_t b) { return (uint64_t(a) << kIdBits) | b; }
  static uint64_t pair_hash(uint64_t key) { return key * 0x9E3779B97F4A7C15ull; }

  // The hot tables as plain pointers, so the loops keep them in registers.
  struct Tables {
    const Split* split;
    const uint64_t* filter;
    const uint64_t* pairs;
    const uint32_t* pair2;  // nullptr until built (or if byte tokens are not ranks 0..255)
    const PrefixTrie* trie;
    size_t pmask;
  };
  Tables tables() const {
    return Tables{&split_[0], &filter_[0], &pairs_[0], bytes_low_ && pair2_.size() ? &pair2_[0] : nullptr, &trie_,
                  pmask_};
  }

  // On random text a third of the lookups are two byte tokens, and nearly all of them merge: the
  // direct table answers them from a few hot lines instead of the filter plus a probe.
  static uint32_t pair_lookup(const Tables& T, uint32_t a, uint32_t b) {
    if ((a | b) < 256 && T.pair2) return T.pair2[(a << 8) | b];
    return pair_lookup_hashed(T, a, b);
  }

  static uint32_t pair_lookup_hashed(const Tables& T, uint32_t a, uint32_t b) {
    const uint64_t key = pair_key(a, b), h = pair_hash(key);
    const uint64_t bits = filter_bits(h);
    if ((T.filter[(h >> 20) & kFilterMask] & bits) != bits) return kNone;  // most pairs: no merge
    for (size_t i = (h >> 32) & T.pmask;; i = (i + 1) & T.pmask) {
      const uint64_t s = T.pairs[i];
      if ((s >> kIdBits) == key) return uint32_t(s & kIdMask);
      if (s == kEmpty) return kNone;
    }
  }

  // Three bits per pair in one filter word: still one load, and false positives (each a probe
  // that misses the cache; about half the probes on random text with one bit) drop ~7-fold.
  static uint64_t filter_bits(uint64_t h) {
    return (uint64_t(1) << (h >> 58)) | (uint64_t(1) << ((h >> 52) & 63)) | (uint64_t(1) << ((h >> 40) & 63));
  }

  void insert_pair(uint32_t a, uint32_t b, uint32_t merged) {
    const uint64_t key = pair_key(a, b), h = pair_hash(key);
    filter_[(h >> 20) & kFilterMask] |= filter_bits(h);
    size_t i = (h >> 32) & pmask_;
    while (pairs_[i] != kEmpty) i = (i + 1) & pmask_;
    pairs_[i] = (key << kIdBits) | merged;
  }

  // The hint for token a taken at a position where [longer, end) are the longer candidates: the
  // ones whose split starts with a are all the merges of a with what follows it there.
  // a has la bytes at s; the splits of tokens of up to three bytes come from the bytes (SmallPairs).
  // kSmall3: small_.ok() is known.
  template <bool kSmall3>
  Hint hint_after(const Tables& T, uint32_t a, uint32_t la, const uint8_t* s, const Cand* longer,
                  const Cand* end) const {
    Hint h{kNone, kNone};
    for (; longer != end; ++longer) {
      Split sp;
      if (longer->len <= 3 && (kSmall3 || small_.ok())) {
        const uint32_t l = small_.left_len(s, longer->len);
        sp = Split{l == la ? a : kNone, small_.token_at(s + l, longer->len - l)};
      } else {
        sp = T.split[longer->tok];
      }
      if (sp.a == a) {
        if (h.partner != kNone) return Hint{kUnknown, kNone};
        h = Hint{sp.b, longer->tok};
      }
    }
    return h;
  }

  // The rank of the merge that takes the last byte of token a (la = 2 or 3 bytes at s): a itself
  // if it has two bytes or splits after two, else its right part, the token of its last two.
  uint32_t last_byte_merge(uint32_t a, uint32_t la, const uint8_t* s) const {
    return la == 2 || small_.left_len(s, 3) == 2 ? a : trie_.token2(s + 1);
  }

  // Do the first (up to) 64 bytes of p[0, n) look like varied ASCII: all below 0x80, and the byte
  // changing at 16 or more of them? Only picks the loop: dead_end is exact on any bytes.
  static bool varied_ascii(const uint8_t* p, size_t n) {
    const size_t m = n < 64 ? n : 64;
    uint32_t high = 0, changes = 0;
    for (size_t i = 0; i < m; ++i) {
      high |= p[i];
      changes += i && p[i] != p[i - 1];
    }
    return high < 0x80 && changes >= (m >> 2);
  }

  // Is token c (2 or 3 bytes at s, ending at e < n) a dead end, where no token can follow it? Its
  // last byte y stays alone until the merge of rank r (last_byte_merge), and y z (z: the next byte)
  // is a token of rank yz < r: BPE merges y z before r unless z is gone by then, so z must first
  // merge rightwards, into a prefix token of what follows it (a candidate of two or more bytes at
  // e) of rank below yz. If there is none, every pair check after c fails, which the main loop
  // would find only after taking it, then back up. (On random letters 3/4 of the back-ups follow
  // a two-byte token, nearly all of this kind; each cost a take, failed checks and a back-up,
  // mostly mispredicted.) next holds the walk at `at` (nnext candidates); if the check needs the
  // walk at e it moves it there, which the main loop then reuses after taking c.
  bool dead_end(const Tables& T, Cand c, const uint8_t* s, size_t e, size_t n, size_t& at,
                size_t& nnext, Cand* next) const {
    const uint8_t* z = s + c.len;
    const uint32_t yz = T.pair2[(trie_.byte_tok(z[-1]) << 8) | trie_.byte_tok(z[0])];
    if (!(yz < c.tok) || (c.len == 3 && !(yz < last_byte_merge(c.tok, c.len, s)))) return false;
    if (at != e) {
      at = e;
      nnext = trie_.walk(z, n - e, next);
    }
    for (size_t j = 1; j < nnext; ++j)
      if (next[j].tok < yz) return false;
    return true;
  }

  // dead_end with fewer branches where the walk at e is at hand (the longest candidate): each of
  // dead_end's went either way at random on random letters.
  bool dead_end_at(const Tables& T, Cand c, const uint8_t* s, size_t e, size_t n, size_t& at, size_t& nnext,
                   Cand* next) const {
    if (at != e) return dead_end(T, c, s, e, n, at, nnext, next);
    const uint8_t* z = s + c.len;
    const uint32_t yz = T.pair2[(trie_.byte_tok(z[-1]) << 8) | trie_.byte_tok(z[0])];
    // the least rank of the candidates of two or more bytes at e (the first two by selects: the
    // count varies at random)
    const uint32_t m1 = nnext > 1 ? next[1].tok : kNone, m2 = nnext > 2 ? next[2].tok : kNone;
    uint32_t m = std::min(m1, m2);
    for (size_t j = 3; j < nnext; ++j) m = std::min(m, next[j].tok);
    const bool dead = (yz < c.tok) & !(m < yz);
    if (c.len == 3) return dead & (yz < last_byte_merge(c.tok, c.len, s));
    return dead;
  }

  // Could BPE put token b (lb bytes, starting at `at`) right after token a (la bytes, hint h)?
  // Forced inline: with two copies of the loop GCC stopped inlining it into either, which cost
  // runs of Han (that never see the skip) ~5%.
  // kShort, kSmall3: small_.short_ok(), small_.ok() are known.
  template <bool kShort, bool kSmall3>
  __attribute__((always_inline)) bool valid_next(const Tables& T, uint32_t a, uint32_t la, const Hint& h,
                                                 uint32_t b, uint32_t lb, const uint8_t* at) const {
    if ((kShort || small_.short_ok()) && h.partner != kUnknown) {
      if (((la - 1) | (lb - 1)) < 2)  // both of one or two bytes
        return small_.valid_short(a, la, b, lb, at, h.partner, h.merged, T.pair2);
      if (la <= 3 && lb <= 3 && (kSmall3 || small_.ok()))
        return small_.valid(a, la, b, lb, at, h.partner, h.merged, T.pair2,
                            [&](uint32_t x, uint32_t y) { return pair_lookup_hashed(T, x, y); });
    }
    if constexpr (kShort) return valid_pair_cold(T, a, b, h.partner, h.merged);
    return valid_pair(T, a, b, h);
  }
  // valid_pair out of line, for the loop where it is rare (varied ASCII: long tokens, unknown
  // hints): inlined, its values took registers the common path needed, and were spilled.
  // (The hint by value: by reference it had to be kept in memory for the call.)
  __attribute__((noinline)) static bool valid_pair_cold(const Tables& T, uint32_t a, uint32_t b, uint32_t partner,
                                                        uint32_t merged) {
    return valid_pair(T, a, b, Hint{partner, merged});
  }

  // valid_pair with the merges of a known from its hint: while a itself is on the left of the
  // boundary (the common case: b unwinds first, or a is a byte), no pair lookup is needed.
  static bool valid_pair(const Tables& T, uint32_t a, uint32_t b, const Hint& h) {
    if (h.partner == kUnknown) return valid_pair(T, a, b);
    __builtin_prefetch(&T.split[a]);
    __builtin_prefetch(&T.split[b]);
    uint32_t limit = kNone;
    for (;;) {
      const uint32_t m = b == h.partner ? h.merged : kNone;
      if (m < limit) return false;
      if (a > b) {
        limit = a;
        const uint32_t na = T.split[a].b;
        if (na != a) return valid_from(T, na, b, limit);
        limit = b + 1;  // a is a base token: unwind b instead
        b = T.split[b].a;
        if (b + 1 == limit) return true;
      } else {
        limit = b + 1;
        b = T.split[b].a;
        if (b + 1 == limit) {  // b is a base token: unwind a instead
          limit = a;
          const uint32_t na = T.split[a].b;
          if (na == a) return true;
          return valid_from(T, na, b, limit);
        }
      }
    }
  }

  // Could BPE end with token a immediately followed by token b? Undo the later of the two merges
  // step by step; if at some step the two boundary tokens merge into a token BPE would have formed
  // earlier (rank below `limit`), the pair is invalid.
  static bool valid_pair(const Tables& T, uint32_t a, uint32_t b) {
    __builtin_prefetch(&T.split[a]);  // both spines' first records load in parallel
    __builtin_prefetch(&T.split[b]);
    return valid_from(T, a, b, kNone);
  }
  static bool valid_from(const Tables& T, uint32_t a, uint32_t b, uint32_t limit) {
    for (;;) {
      uint32_t m = pair_lookup(T, a, b);
      if (m != kNone && m < limit) return false;
      if (a > b) {
        limit = a;
        a = T.split[a].b;
        if (a == limit) {  // a is a base token: unwind b instead
          limit = b + 1;
          b = T.split[b].a;
          if (b + 1 == limit) return true;
        }
      } else {
        limit = b + 1;
        b = T.split[b].a;
        if (b + 1 == limit) {  // b is a base token: unwind a instead
          limit = a;
          a = T.split[a].b;
          if (a == limit) return true;
        }
      }
    }
  }

  const Vocab* V_ = nullptr;
  bool ok_ = false;
  PrefixTrie trie_;
  // the tables are probed at random: huge pages keep the TLB from missing on top of the caches
  HugeArray<Split> split_;
  HugeArray<uint64_t> pairs_;
  HugeArray<uint32_t> pair2_;
  bool bytes_low_ = false;
  SmallPairs small_;  // checks of pairs of short tokens from the bytes
  uint32_t skip_lens_ = 0;  // dead_end is checked after tokens of 2 .. skip_lens_ + 1 bytes
  size_t pmask_ = 0;
  // one bit per pair hash (256 KiB, stays in L2): rules out most pair lookups cheaply
  static constexpr size_t kFilterMask = (size_t(1) << 15) - 1;
  HugeArray<uint64_t> filter_;
};

}  // namespace k3tok
