// The vocabulary as a prefix trie, for the linear encoder (linear_bpe.h): a walk lists every token
// that prefixes the text at a position.
//
// Layout, for random text (where every step can miss a cache): a double array (a child is one load
// at base + byte, with its token id in the same 12 bytes), entered through direct tables for the
// first two bytes and for whether a third byte continues; on random letters most walks end there,
// in small hot ranges of those tables. The tables sit on huge pages.
#pragma once
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "vocab.h"

namespace k3tok {

class PrefixTrie {
 public:
  struct Cand {  // a token that prefixes the text, and its length
    uint32_t tok, len;
  };

  void build(const Vocab& V) {
    for (int b = 0; b < 256; ++b) byte_tok_[b] = V.byte_rank(uint8_t(b));
    build_cells(V);
  }

  uint32_t byte_tok(uint8_t b) const { return byte_tok_[b]; }

  // Writes the tokens that are prefixes of p[0, n), shortest first, to cand; returns how many
  // (>= 1: every single byte is a token).
  size_t walk(const uint8_t* p, size_t n, Cand* cand) const {
    cand[0] = Cand{byte_tok_[p[0]], 1};
    if (n < 2) return 1;
    const uint32_t ab = (uint32_t(p[0]) << 8) | p[1];
    const Two two = two_[two_index(ab)];
    size_t k = 1;
    if (two.tok != kNone) cand[k++] = Cand{two.tok, 2};
    if (n < 3 || !((three_[three_word(ab, p[2])] >> (p[2] & 63)) & 1)) return k;
    uint32_t cell = two.base + p[2];  // the cell after three bytes exists: no check
    const Node* c = &cells_[cell];
    if (c->tok != kNone) cand[k++] = Cand{c->tok, 3};
    for (size_t i = 3; i < n; ++i) {
      uint32_t t = c->base + p[i];
      const Node* d = &cells_[t];
      if (d->check != cell) break;
      cell = t;
      c = d;
      if (c->tok != kNone) cand[k++] = Cand{c->tok, uint32_t(i + 1)};
    }
    return k;
  }

  // The token of the two bytes at t, or kNone.
  uint32_t token2(const uint8_t* t) const { return two_[two_index((uint32_t(t[0]) << 8) | t[1])].tok; }

  // The token of the three bytes at t, where the trie has a cell after them.
  uint32_t token3_known(const uint8_t* t) const {
    return cells_[two_[two_index((uint32_t(t[0]) << 8) | t[1])].base + t[2]].tok;
  }

  // The token of the three bytes at t, or kNone (from the hot direct tables and one cell).
  uint32_t token3(const uint8_t* t) const {
    const uint32_t ab = (uint32_t(t[0]) << 8) | t[1];
    if (!((three_[three_word(ab, t[2])] >> (t[2] & 63)) & 1)) return kNone;
    return cells_[two_[two_index(ab)].base + t[2]].tok;
  }

 private:
  struct Two {  // after two bytes: the token, and where the trie cell's children are
    uint32_t tok, base;
  };
  struct Node {  // double-array trie cell
    uint32_t base;   // children at base + byte
    uint32_t check;  // parent cell (kNone: free)
    uint32_t tok;    // token ending here, or kNone
  };

  // The double-array trie: cells are placed breadth first, each node's children at the lowest
  // base where all their bytes are free.
  void build_cells(const Vocab& V) {
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
    // direct tables for the first two bytes and for the existence of a third: on random text
    // most walks end there, after two loads from small hot ranges of these tables
    two_.assign(kRows * 256, Two{kNone, 0});
    three_.assign(4 * kRows * 256, 0);
    for (int a = 0; a < 256; ++a) {
      uint32_t c1 = child(0, uint8_t(a));
      if (!c1) continue;
      for (int b = 0; b < 256; ++b) {
        uint32_t c2 = child(c1, uint8_t(b));
        if (!c2) continue;
        const uint32_t ab = uint32_t(a << 8) | uint32_t(b);
        two_[two_index(ab)] = Two{cells_[c2].tok, cells_[c2].base};
        for (int c = 0; c < 256; ++c)
          if (child(c2, uint8_t(c))) three_[three_word(ab, uint8_t(c))] |= uint64_t(1) << (c & 63);
      }
    }
  }

  // Where bytes a b (ab) index two_: rows of 264 entries, not 256, so that a row starts one cache
  // line further into the L1 sets than the one before. With 2 KiB rows the entries the text uses
  // (lowercase: 4 lines per row) of every other row fell into the same 4 of the 64 sets, more
  // lines than a set holds.
  static constexpr uint32_t kRows = 264;
  static uint32_t two_index(uint32_t ab) { return ab + ((ab >> 8) << 3); }
  // The word of three_ for bytes a b (ab) and c: by c's quarter first, so that the words of the
  // text's two-byte prefixes lie together (lowercase letters: 85 cache lines, not 338), in rows
  // as two_'s.
  static uint32_t three_word(uint32_t ab, uint8_t c) { return uint32_t(c >> 6) * (kRows * 256) + two_index(ab); }

  uint32_t child(uint32_t cell, uint8_t b) const {
    uint32_t t = cells_[cell].base + b;
    return cells_[t].check == cell ? t : 0;
  }

  uint32_t byte_tok_[256];
  HugeArray<Node> cells_;
  HugeArray<Two> two_;
  HugeArray<uint64_t> three_;  // bit c & 63 of three_word(ab, c): the trie has a cell after a, b, c
};

}  // namespace k3tok
