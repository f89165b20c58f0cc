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
// Layout, for random text (where every step can miss a cache): the prefix trie is a double array
// (a child is one load at base + byte, with its token id in the same 12 bytes), and one walk lists
// every candidate at a position with its length; `valid_pair` touches only the 8-byte split
// records, a 256 KiB filter, the merge table (a pair and its result packed in 8 bytes, 2 MiB for
// Kimi) and, for two byte tokens (a third of the lookups on random text), a direct table. The
// tables sit on huge pages. The walk from the end of the likeliest next token runs before that
// token is validated, so their cache misses overlap; a back-up walks the trie again.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "vocab.h"

namespace k3tok {

class LinearBpe {
 public:
  // Returns false (and leaves the encoder disabled) if the vocabulary fails the self-check.
  bool build(const Vocab& V) {
    V_ = &V;
    const size_t n = V.size();
    if (n >= kMaxTokens) return false;  // the merge table packs ids in 21 bits
    for (int b = 0; b < 256; ++b) byte_tok_[b] = V.byte_rank(uint8_t(b));
    build_trie(V);
    std::vector<Cand> cand(V.max_token_len() + 1);
    std::vector<uint32_t> next_prefix(n, kNone);  // longest token that is a proper prefix
    for (uint32_t id = 0; id < n; ++id)
      if (V.has(id) && V.len(id) > 1) {
        size_t k = walk(V.bytes(id), V.len(id) - 1, cand.data());
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
    for (int c = 0; c < 256; ++c) bytes_low_ = bytes_low_ && byte_tok_[c] < 256;
    pair2_.assign(size_t(1) << 16, kNone);
    if (bytes_low_) {
      const Tables T = tables();
      for (uint32_t x = 0; x < 256; ++x)
        for (uint32_t y = 0; y < 256; ++y) pair2_[(x << 8) | y] = pair_lookup_hashed(T, x, y);
    }
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
    const size_t base = out.size();
    out.resize(base + n);  // at most one token per byte; trimmed at the end
    uint32_t* const o = out.data() + base;
    size_t k = 0;  // tokens so far
    std::vector<uint64_t> reach_v(n / 64 + 1, ~uint64_t(0));
    uint64_t* const reach = reach_v.data();
    // candidates at pos, shortest first: the prefix tokens the trie walk passed
    std::vector<Cand> cand_v(V_->max_token_len() + 1);
    std::vector<Cand> next_v(V_->max_token_len() + 1);
    Cand* cand = cand_v.data();
    Cand* next = next_v.data();
    std::unique_ptr<uint32_t[]> lens_v(new uint32_t[n]);  // byte length of each token in o
    uint32_t* const lens = lens_v.get();
    const Tables T = tables();
    size_t nc = walk(p, n, cand);
    size_t pos = 0;
    for (;;) {
      const uint32_t last = k ? o[k - 1] : kNone;
      // the longest candidate usually fits: walk from its end now (see the header comment)
      const size_t spec = nc ? pos + cand[nc - 1].len : n;
      const size_t nspec = spec < n ? walk(p + spec, n - spec, next) : 0;
      while (nc) {
        const Cand c = cand[--nc];
        const size_t e = pos + c.len;
        if (((reach[e >> 6] >> (e & 63)) & 1) && (last == kNone || valid_pair(T, last, c.tok))) {
          lens[k] = c.len;
          o[k++] = c.tok;
          pos = e;
          goto taken;
        }
      }
      if (last == kNone) {  // nothing fits at the start: not encodable this way
        out.resize(base);
        return false;
      }
      // back up one token; retry its position with the tokens shorter than it (walking the trie
      // again there: its cells were read a moment ago, the prefix links of `last` were not)
      reach[pos >> 6] &= ~(uint64_t(1) << (pos & 63));
      --k;
      {
        const uint32_t len = lens[k];
        pos -= len;
        nc = walk(p + pos, n - pos, cand);
        while (nc && cand[nc - 1].len >= len) --nc;
      }
      continue;
    taken:
      if (pos == n) break;
      if (pos == spec) {  // spec < n here
        std::swap(cand, next);
        nc = nspec;
      } else {
        nc = walk(p + pos, n - pos, cand);
      }
    }
    out.resize(base + k);
    return true;
  }

 private:
  struct Split {  // the pair BPE merges into this token (a == b == id: a base token)
    uint32_t a, b;
  };
  struct Cand {
    uint32_t tok, len;
  };
  struct Node {  // double-array trie cell
    uint32_t base;   // children at base + byte
    uint32_t check;  // parent cell (kNone: free)
    uint32_t tok;    // token ending here, or kNone
  };
  static constexpr size_t kIdBits = 21;
  static constexpr uint64_t kIdMask = (uint64_t(1) << kIdBits) - 1;
  static constexpr size_t kMaxTokens = kIdMask;  // all-ones is the empty slot
  static constexpr uint64_t kEmpty = ~uint64_t(0);

  // The double-array trie: cells are placed breadth first, each node's children at the lowest
  // base where all their bytes are free.
  void build_trie(const Vocab& V) {
    std::vector<uint32_t> order;
    for (uint32_t id = 0; id < V.size(); ++id)
      if (V.has(id)) order.push_back(id);
    auto less = [&](uint32_t x, uint32_t y) {
      return std::lexicographical_compare(V.bytes(x), V.bytes(x) + V.len(x), V.bytes(y), V.bytes(y) + V.len(y));
    };
    std::sort(order.begin(), order.end(), less);
    struct Tmp {
      uint32_t tok = kNone, first = 0, count = 0;  // children: kids_[first, first + count)
    };
    // a plain trie first: in sorted order a token's path shares only the last child at each level
    std::vector<Tmp> tmp(1);
    std::vector<std::vector<std::pair<uint8_t, uint32_t>>> kids(1);
    for (uint32_t id : order) {
      uint32_t node = 0;
      for (uint32_t k = 0; k < V.len(id); ++k) {
        uint8_t c = V.bytes(id)[k];
        if (kids[node].empty() || kids[node].back().first != c) {
          kids[node].emplace_back(c, uint32_t(tmp.size()));
          tmp.emplace_back();
          kids.emplace_back();
        }
        node = kids[node].back().second;
      }
      tmp[node].tok = id;
    }
    std::vector<Node> cells(512, Node{0, kNone, kNone});
    std::vector<uint8_t> used(512, 0);
    used[0] = 1;
    size_t first_free = 1;
    std::vector<std::pair<uint32_t, uint32_t>> queue{{0, 0}};  // (tmp node, cell)
    for (size_t q = 0; q < queue.size(); ++q) {
      auto [t, cell] = queue[q];
      cells[cell].tok = tmp[t].tok;
      const auto& ks = kids[t];
      if (ks.empty()) continue;
      while (used[first_free]) ++first_free;
      size_t b = first_free > ks[0].first ? first_free - ks[0].first : 1;
      for (;; ++b) {
        if (b + 256 >= used.size()) {
          used.resize(2 * used.size(), 0);
          cells.resize(used.size(), Node{0, kNone, kNone});
        }
        bool fits = true;
        for (const auto& kv : ks)
          if (used[b + kv.first]) {
            fits = false;
            break;
          }
        if (fits) break;
      }
      cells[cell].base = uint32_t(b);
      for (const auto& kv : ks) {
        used[b + kv.first] = 1;
        cells[b + kv.first].check = cell;
        queue.emplace_back(kv.second, uint32_t(b + kv.first));
      }
    }
    size_t top = used.size();
    while (top > 1 && !used[top - 1]) --top;
    cells.resize(top + 256, Node{0, kNone, kNone});  // base + byte stays in range
    cells_.assign(cells.size(), Node{0, kNone, kNone});
    std::copy(cells.begin(), cells.end(), &cells_[0]);
    // direct table for the first two bytes: most walks start with one cell load
    two_.assign(1 << 16, 0);
    for (int a = 0; a < 256; ++a) {
      uint32_t c1 = child(0, uint8_t(a));
      if (c1)
        for (int b = 0; b < 256; ++b) two_[(a << 8) | b] = child(c1, uint8_t(b));
    }
  }

  uint32_t child(uint32_t cell, uint8_t b) const {
    uint32_t t = cells_[cell].base + b;
    return cells_[t].check == cell ? t : 0;
  }

  // Writes the tokens that are prefixes of p[0, n), shortest first, to cand; returns how many
  // (>= 1: every single byte is a token).
  size_t walk(const uint8_t* p, size_t n, Cand* cand) const {
    cand[0] = Cand{byte_tok_[p[0]], 1};
    if (n < 2) return 1;
    uint32_t cell = two_[(uint32_t(p[0]) << 8) | p[1]];
    if (!cell) return 1;
    size_t k = 1;
    const Node* c = &cells_[cell];
    if (c->tok != kNone) cand[k++] = Cand{c->tok, 2};
    for (size_t i = 2; i < n; ++i) {
      uint32_t t = c->base + p[i];
      const Node* d = &cells_[t];
      if (d->check != cell) break;
      cell = t;
      c = d;
      if (c->tok != kNone) cand[k++] = Cand{c->tok, uint32_t(i + 1)};
    }
    return k;
  }

  static uint64_t pair_key(uint32_t a, uint32_t b) { return (uint64_t(a) << kIdBits) | b; }
  static uint64_t pair_hash(uint64_t key) { return key * 0x9E3779B97F4A7C15ull; }

  // The hot tables as plain pointers, so the loops keep them in registers.
  struct Tables {
    const Split* split;
    const uint64_t* filter;
    const uint64_t* pairs;
    const uint32_t* pair2;  // nullptr until built (or if byte tokens are not ranks 0..255)
    size_t pmask;
  };
  Tables tables() const {
    return Tables{&split_[0], &filter_[0], &pairs_[0], bytes_low_ && pair2_.size() ? &pair2_[0] : nullptr, pmask_};
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

  // Could BPE end with token a immediately followed by token b? Undo the later of the two merges
  // step by step; if at some step the two boundary tokens merge into a token BPE would have formed
  // earlier (rank below `limit`), the pair is invalid.
  static bool valid_pair(const Tables& T, uint32_t a, uint32_t b) {
    __builtin_prefetch(&T.split[a]);  // both spines' first records load in parallel
    __builtin_prefetch(&T.split[b]);
    uint32_t limit = kNone;
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
  uint32_t byte_tok_[256];
  // the tables are probed at random: huge pages keep the TLB from missing on top of the caches
  HugeArray<Split> split_;
  HugeArray<Node> cells_;
  HugeArray<uint32_t> two_;
  HugeArray<uint64_t> pairs_;
  HugeArray<uint32_t> pair2_;
  bool bytes_low_ = false;
  size_t pmask_ = 0;
  // one bit per pair hash (256 KiB, stays in L2): rules out most pair lookups cheaply
  static constexpr size_t kFilterMask = (size_t(1) << 15) - 1;
  HugeArray<uint64_t> filter_;
};

}  // namespace k3tok
