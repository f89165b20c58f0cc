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
#pragma once
#include <cstdint>
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
    if (V.size() >= (size_t(1) << 24)) return false;  // trie keys pack node << 8
    size_t n = V.size();
    build_trie(V);
    next_prefix_.assign(n, kNone);
    for (uint32_t id = 0; id < n; ++id)
      if (V.has(id) && V.len(id) > 1) next_prefix_[id] = longest_prefix(V.bytes(id), V.len(id) - 1);
    split_.assign(n, {kNone, kNone});
    size_t cap = 16;
    while (cap < 2 * n + 1) cap <<= 1;
    pairs_.assign(cap, PairSlot{kNone, kNone, kNone});
    pmask_ = cap - 1;
    filter_.assign(kFilterMask + 1, 0);
    for (uint32_t id = 0; id < n; ++id) {
      if (!V.has(id)) continue;
      split_[id] = {id, id};
      for (uint32_t a = next_prefix_[id]; a != kNone; a = next_prefix_[a]) {
        const uint8_t* rest = V.bytes(id) + V.len(a);
        uint32_t b = V.find(rest, V.len(id) - V.len(a), rest + V.len(id) - V.len(a) + 8);
        if (b != kNone && a < id && b < id && valid_pair(a, b)) {
          split_[id] = {a, b};
          insert_pair(a, b, id);
          break;
        }
      }
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
    const size_t base = out.size();
    std::vector<uint64_t> reachable(n / 64 + 1, ~uint64_t(0));
    size_t pos = 0;
    uint32_t next = n ? longest_prefix(p, n) : kNone;
    while (next != kNone) {
      uint32_t tok = next;
      uint32_t last = out.size() > base ? out.back() : kNone;
      for (;;) {
        size_t e = pos + V_->len(tok);
        if (((reachable[e >> 6] >> (e & 63)) & 1) && (last == kNone || valid_pair(last, tok))) {
          out.push_back(tok);
          pos = e;
          next = pos < n ? longest_prefix(p + pos, n - pos) : kNone;
          break;
        }
        if (next_prefix_[tok] != kNone) {
          tok = next_prefix_[tok];
          continue;
        }
        if (last == kNone) {
          out.resize(base);
          return false;
        }
        reachable[pos >> 6] &= ~(uint64_t(1) << (pos & 63));
        out.pop_back();
        pos -= V_->len(last);
        next = last;
        break;
      }
    }
    if (pos != n) {
      out.resize(base);
      return false;
    }
    return true;
  }

 private:
  struct ChildSlot {
    uint32_t key;  // parent << 8 | byte; 0 = empty (parents are >= 1)
    uint32_t child;
  };
  struct PairSlot {
    uint32_t a, b, merged;
  };

  static uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
  }

  void build_trie(const Vocab& V) {
    node_token_.assign(1, kNone);  // node 0 is the root
    children_.assign(1 << 16, ChildSlot{0, 0});
    cmask_ = children_.size() - 1;
    used_ = 0;
    for (int b = 0; b < 256; ++b) root_[b] = 0;
    for (uint32_t id = 0; id < V.size(); ++id) {
      if (!V.has(id)) continue;
      const uint8_t* p = V.bytes(id);
      uint32_t node = 0;
      for (uint32_t k = 0; k < V.len(id); ++k) {
        uint32_t c = child(node, p[k]);
        if (!c) {
          c = uint32_t(node_token_.size());
          node_token_.push_back(kNone);
          set_child(node, p[k], c);
        }
        node = c;
      }
      node_token_[node] = id;
    }
    // direct table for the first two bytes: most lookups never touch the hash table
    two_.assign(1 << 16, 0);
    for (int a = 0; a < 256; ++a)
      if (root_[a])
        for (int b = 0; b < 256; ++b) two_[(a << 8) | b] = child(root_[a], uint8_t(b));
  }

  uint32_t child(uint32_t node, uint8_t b) const {
    if (node == 0) return root_[b];
    uint32_t key = (node << 8) | b;
    for (size_t i = mix32(key) & cmask_;; i = (i + 1) & cmask_) {
      if (children_[i].key == key) return children_[i].child;
      if (children_[i].key == 0) return 0;
    }
  }

  void set_child(uint32_t node, uint8_t b, uint32_t c) {
    if (node == 0) {
      root_[b] = c;
      return;
    }
    if (2 * (used_ + 1) > children_.size()) {  // keep the load factor under 1/2
      std::vector<ChildSlot> old;
      old.swap(children_);
      children_.assign(old.size() * 2, ChildSlot{0, 0});
      cmask_ = children_.size() - 1;
      for (const ChildSlot& s : old)
        if (s.key) place(s);
    }
    place(ChildSlot{(node << 8) | b, c});
    ++used_;
  }

  void place(const ChildSlot& s) {
    size_t i = mix32(s.key) & cmask_;
    while (children_[i].key) i = (i + 1) & cmask_;
    children_[i] = s;
  }

  // Longest token that is a prefix of p[0, n), n >= 1 (every single byte is a token).
  uint32_t longest_prefix(const uint8_t* p, size_t n) const {
    uint32_t node = root_[p[0]];
    uint32_t best = node_token_[node];
    if (n < 2) return best;
    node = two_[(uint32_t(p[0]) << 8) | p[1]];
    for (size_t k = 2; node; ++k) {
      if (node_token_[node] != kNone) best = node_token_[node];
      if (k >= n) break;
      node = child(node, p[k]);
    }
    return best;
  }

  static uint32_t pair_hash(uint32_t a, uint32_t b) { return mix32(a * 0x9E3779B1u ^ b); }

  uint32_t pair_lookup(uint32_t a, uint32_t b) const {
    uint32_t h = pair_hash(a, b);
    if (!((filter_[(h >> 6) & kFilterMask] >> (h & 63)) & 1)) return kNone;  // most pairs: no merge
    for (size_t i = h & pmask_;; i = (i + 1) & pmask_) {
      const PairSlot& s = pairs_[i];
      if (s.a == a && s.b == b) return s.merged;
      if (s.a == kNone) return kNone;
    }
  }

  void insert_pair(uint32_t a, uint32_t b, uint32_t merged) {
    uint32_t h = pair_hash(a, b);
    filter_[(h >> 6) & kFilterMask] |= uint64_t(1) << (h & 63);
    size_t i = h & pmask_;
    while (pairs_[i].a != kNone) i = (i + 1) & pmask_;
    pairs_[i] = PairSlot{a, b, merged};
  }

  // Could BPE end with token a immediately followed by token b? Undo the later of the two merges
  // step by step; if at some step the two boundary tokens merge into a token BPE would have formed
  // earlier (rank below `limit`), the pair is invalid.
  bool valid_pair(uint32_t a, uint32_t b) const {
    uint32_t limit = kNone;
    for (;;) {
      uint32_t m = pair_lookup(a, b);
      if (m != kNone && m < limit) return false;
      if (a > b) {
        limit = a;
        a = split_[a].second;
        if (a == limit) {  // a is a base token: unwind b instead
          limit = b + 1;
          b = split_[b].first;
          if (b + 1 == limit) return true;
        }
      } else {
        limit = b + 1;
        b = split_[b].first;
        if (b + 1 == limit) {  // b is a base token: unwind a instead
          limit = a;
          a = split_[a].second;
          if (a == limit) return true;
        }
      }
    }
  }

  const Vocab* V_ = nullptr;
  bool ok_ = false;
  uint32_t root_[256];
  std::vector<uint32_t> node_token_;
  std::vector<ChildSlot> children_;
  size_t cmask_ = 0;
  std::vector<uint32_t> next_prefix_;
  std::vector<std::pair<uint32_t, uint32_t>> split_;
  std::vector<PairSlot> pairs_;
  size_t pmask_ = 0;
  // one bit per pair hash (512 KiB, stays in L2): rules out most pair lookups without a miss
  static constexpr size_t kFilterMask = (size_t(1) << 16) - 1;
  std::vector<uint64_t> filter_;
  std::vector<uint32_t> two_;
  size_t used_ = 0;
};

}  // namespace k3tok
