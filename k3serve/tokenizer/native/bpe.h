// Byte-pair merging in tiktoken's order: repeatedly merge the adjacent pair whose concatenation has
// the lowest rank, leftmost first on ties.
//   merge_small   O(n^2) scan, what tiktoken does for short pieces;
//   merge_heap    O(n log n) with a lazy heap, same result, for long pieces when the linear encoder
//                 is unavailable;
//   LinearBpe     (linear_bpe.h) for long pieces.
#pragma once
#include <algorithm>
#include <cstdint>
#include <queue>
#include <vector>

#include "vocab.h"

namespace k3tok {

constexpr size_t kSmallPiece = 128;  // merge_small handles pieces shorter than this

// Appends the tokens of p[0, n) (n >= 2, n < kSmallPiece) to out.
inline void merge_small(const Vocab& V, const uint8_t* p, size_t n, const uint8_t* end,
                        std::vector<uint32_t>& out) {
  // parts[i] = start of part i; rank[i] = rank of parts i and i+1 merged (kNone if not a token)
  uint32_t start[kSmallPiece + 1];
  uint32_t rank[kSmallPiece + 1];
  size_t m = n + 1;  // part boundaries, the last one is n
  for (size_t i = 0; i <= n; ++i) start[i] = uint32_t(i);
  auto pair_rank = [&](size_t i) -> uint32_t {  // needs i + 2 < m
    return V.find(p + start[i], start[i + 2] - start[i], end);
  };
  for (size_t i = 0; i + 2 < m; ++i) rank[i] = pair_rank(i);
  rank[m - 2] = kNone;
  rank[m - 1] = kNone;
  while (m > 2) {
    uint32_t best = kNone;
    size_t bi = 0;
    for (size_t i = 0; i + 2 < m; ++i)
      if (rank[i] < best) {
        best = rank[i];
        bi = i;
      }
    if (best == kNone) break;
    // merge parts bi and bi+1 by dropping boundary bi+1
    for (size_t i = bi + 1; i + 1 < m; ++i) {
      start[i] = start[i + 1];
      rank[i] = rank[i + 1];
    }
    --m;
    rank[m - 1] = kNone;
    if (bi + 2 < m) rank[bi] = pair_rank(bi);
    else rank[bi] = kNone;
    if (bi > 0) rank[bi - 1] = pair_rank(bi - 1);
  }
  for (size_t i = 0; i + 1 < m; ++i) out.push_back(V.find(p + start[i], start[i + 1] - start[i], end));
}

// Same result as merge_small for any n, in O(n log n).
inline void merge_heap(const Vocab& V, const uint8_t* p, size_t n, const uint8_t* end,
                       std::vector<uint32_t>& out) {
  // parts are a linked list over byte offsets; part i covers [i, nxt[i])
  std::vector<uint32_t> nxt(n + 1), prv(n + 1), rank(n + 1, kNone);
  for (size_t i = 0; i <= n; ++i) {
    nxt[i] = uint32_t(i + 1);
    prv[i] = i ? uint32_t(i - 1) : kNone;
  }
  auto pair_rank = [&](uint32_t i) -> uint32_t {  // rank of part i merged with its successor
    uint32_t j = nxt[i];
    if (j >= n) return kNone;
    return V.find(p + i, nxt[j] - i, end);
  };
  using Item = std::pair<uint64_t, uint32_t>;  // (rank << 32 | start, start): leftmost on ties
  std::priority_queue<Item, std::vector<Item>, std::greater<Item>> heap;
  for (uint32_t i = 0; i + 1 < n; ++i) {
    rank[i] = pair_rank(i);
    if (rank[i] != kNone) heap.push({(uint64_t(rank[i]) << 32) | i, i});
  }
  while (!heap.empty()) {
    auto [key, i] = heap.top();
    heap.pop();
    if (rank[i] != uint32_t(key >> 32) || rank[i] == kNone) continue;  // stale
    uint32_t j = nxt[i];
    nxt[i] = nxt[j];
    if (nxt[j] <= n) prv[nxt[j]] = i;
    rank[j] = kNone;
    nxt[j] = kNone;  // j is no longer a part start
    rank[i] = pair_rank(i);
    if (rank[i] != kNone) heap.push({(uint64_t(rank[i]) << 32) | i, i});
    if (prv[i] != kNone) {
      uint32_t h = prv[i];
      rank[h] = pair_rank(h);
      if (rank[h] != kNone) heap.push({(uint64_t(rank[h]) << 32) | h, h});
    }
  }
  for (uint32_t i = 0; i < n; i = nxt[i]) out.push_back(V.find(p + i, nxt[i] - i, end));
}

}  // namespace k3tok
