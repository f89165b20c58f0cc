// The encoder: special-token split -> Kimi cuts -> pre-tokenizer -> per-piece lookup / cache / BPE.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "bpe.h"
#include "cuts.h"
#include "linear_bpe.h"
#include "pretokenize.h"
#include "segment_cache.h"
#include "vocab.h"

namespace k3tok {

struct SpecialToken {
  std::string text;
  uint32_t id;
};

// Direct-mapped caches of multi-token pieces, one set per thread (no locks, no allocation on a
// miss): a small tier (up to 22 bytes and 8 ids in one 64-byte slot) and a large tier for pieces
// up to 120 bytes (separator lines, long identifiers) whose O(n^2) merge is worth keeping.
template <size_t kSetsT, size_t kMaxKeyT, size_t kMaxIdsT>
struct PieceTier {  // 2-way set associative; a miss replaces the way not used last
  static constexpr size_t kSets = kSetsT, kMaxKey = kMaxKeyT, kMaxIds = kMaxIdsT;
  struct Slot {
    uint64_t tag;
    uint8_t len, nids;
    uint8_t key[kMaxKey];
    uint32_t ids[kMaxIds];
  };
  std::unique_ptr<Slot[]> slots;
  std::unique_ptr<uint8_t[]> recent;  // way used last, per set

  void reset() {
    if (!slots) {
      slots.reset(new Slot[2 * kSets]);
      recent.reset(new uint8_t[kSets]);
    }
    for (size_t i = 0; i < 2 * kSets; ++i) slots[i].len = 0;
    std::memset(recent.get(), 0, kSets);
  }
  // Appends the cached ids and returns true on a hit; else returns the slot to fill.
  bool get(const uint8_t* p, size_t n, uint64_t h, std::vector<uint32_t>& out, Slot*& slot) {
    size_t set = h & (kSets - 1);
    for (size_t w = 0; w < 2; ++w) {
      Slot& s = slots[2 * set + w];
      if (s.len == n && s.tag == h && bytes_equal(s.key, p, n)) {
        out.insert(out.end(), s.ids, s.ids + s.nids);
        recent[set] = uint8_t(w);
        return true;
      }
    }
    size_t victim = recent[set] ^ 1;
    recent[set] = uint8_t(victim);
    slot = &slots[2 * set + victim];
    return false;
  }
  static void put(Slot* slot, const uint8_t* p, size_t n, uint64_t h, const uint32_t* ids, size_t k) {
    if (k > kMaxIds) return;
    slot->tag = h;
    slot->len = uint8_t(n);
    slot->nids = uint8_t(k);
    std::memcpy(slot->key, p, n);
    std::memcpy(slot->ids, ids, 4 * k);
  }
};

struct PieceCache {
  uint64_t owner = 0;
  PieceTier<1 << 14, 22, 8> small;  // 2 MiB
  PieceTier<1 << 10, 120, 48> large;  // 640 KiB
};

class Core {
 public:
  Core(Vocab&& vocab, std::vector<SpecialToken>&& specials, bool kimi_cuts, size_t cache_bytes,
       size_t cache_min_bytes)
      : V_(std::move(vocab)),
        specials_(std::move(specials)),
        cuts_(kimi_cuts),
        seg_cache_(cache_bytes),
        cache_min_bytes_(cache_min_bytes),
        serial_(next_serial()) {
    std::memset(first_byte_, 0, sizeof(first_byte_));
    for (uint32_t k = 0; k < specials_.size(); ++k) {
      const SpecialToken& t = specials_[k];
      if (t.text.empty()) throw std::invalid_argument("empty special token");
      if (V_.has(t.id)) throw std::invalid_argument("special token id " + std::to_string(t.id) + " is also a rank");
      if (!by_id_.emplace(t.id, k).second)
        throw std::invalid_argument("two special tokens share id " + std::to_string(t.id));
      uint8_t f = uint8_t(t.text[0]);
      if (!first_byte_[f]) first_bytes_.push_back(f);
      first_byte_[f] = 1;
      by_first_[f].push_back(k);
    }
    for (auto& bucket : by_first_)  // longest first, so a longer special wins at the same position
      std::sort(bucket.begin(), bucket.end(),
                [&](uint32_t a, uint32_t b) { return specials_[a].text.size() > specials_[b].text.size(); });
  }

  ~Core() {
    if (builder_.joinable()) builder_.join();
  }
  Core(const Core&) = delete;
  Core& operator=(const Core&) = delete;

  // Builds the linear encoder's tables (~0.3 s for Kimi) on a background thread now, instead of
  // on the first long piece.
  void prebuild() {
    if (!builder_.joinable()) builder_ = std::thread([this] { linear(); });
  }

  const Vocab& vocab() const { return V_; }
  const std::vector<SpecialToken>& specials() const { return specials_; }
  SegmentCache& segment_cache() { return seg_cache_; }
  size_t cache_min_bytes() const { return cache_min_bytes_; }

  // Special token index for id, or -1.
  long special_index(uint32_t id) const {
    auto it = by_id_.find(id);
    return it == by_id_.end() ? -1 : long(it->second);
  }

  // allowed: nullptr = no special token is recognised; else allowed[k] != 0 for recognised ones.
  void encode(const uint8_t* s, size_t n, const uint8_t* allowed, std::vector<uint32_t>& out) const {
    // Grow geometrically: reserving the exact size for each call would reallocate (and copy the whole
    // output) once per segment, quadratic in the number of segments of one prompt.
    size_t want = out.size() + n / 4 + 16;
    if (want > out.capacity()) out.reserve(std::max(want, 2 * out.capacity()));
    PieceCache& pc = piece_cache();
    const uint8_t* end = s + n;
    if (!allowed || specials_.empty()) {
      encode_plain(s, n, end, out, pc);
      return;
    }
    size_t pos = 0;
    size_t next_at[8];
    const size_t nf = first_bytes_.size();
    for (size_t f = 0; f < std::min<size_t>(nf, 8); ++f) next_at[f] = SIZE_MAX;  // unknown
    for (;;) {
      size_t ms = n, mk = 0;
      find_special(s, n, pos, allowed, next_at, ms, mk);
      encode_plain(s + pos, ms - pos, end, out, pc);
      if (ms == n) break;
      out.push_back(specials_[mk].id);
      pos = ms + specials_[mk].text.size();
    }
  }

  // Each piece is looked up as soon as it is scanned (out-of-order execution overlaps the probe
  // with the next scan; probing one piece behind with a prefetch measured 3% slower: more live
  // state, spilled). Pieces of up to 16 bytes (~95% of prose pieces) take one path with a
  // two-word key and no other branch on the length (prose piece lengths are random: a test such
  // as len <= 8 mispredicts), 17-24 bytes one with a three-word key.
  void encode_plain(const uint8_t* s, size_t n, const uint8_t* end, std::vector<uint32_t>& out,
                    PieceCache& pc) const {
    const size_t max_len = V_.max_token_len();
    auto chunk = [&](size_t a, size_t b) {
      const uint8_t* c = s + a;
      const size_t m = b - a;
      Scanner sc(c, m);
      for (size_t i = 0; i < m;) {
        size_t e = sc.next(i);
        const uint8_t* p = c + i;
        size_t len = e - i;
        i = e;
        uint32_t id = kNone;
        uint64_t h = 0;
        if (len <= 16 && size_t(end - p) >= 16) {
          uint64_t w0, w1;
          h = Vocab::key16(p, len, w0, w1);
          id = V_.find16(h, w0, w1, len);
        } else if (len <= 24 && size_t(end - p) >= 24) {  // all but long pieces and the last bytes
          uint64_t w0, w1, w2;
          h = Vocab::key24(p, len, w0, w1, w2);
          id = V_.find24(h, w0, w1, w2, len);
        } else if (len <= max_len) {
          id = V_.find(p, len, end);
        }
        if (id != kNone) {
          out.push_back(id);
        } else if (h && len <= decltype(pc.small)::kMaxKey) {  // ~6% of prose pieces
          cached_small(p, len, (h << 14) | (h >> 50), end, out, pc);  // set: the hash's top bits
        } else {
          encode_merged(p, len, end, out, pc);
        }
      }
    };
    if (cuts_)
      kimi_cuts(s, n, chunk);
    else
      chunk(0, n);
  }

  // mode: 0 = production path, 1 = merge_small, 2 = merge_heap, 3 = linear, 4 = linear without the
  // heap fallback (nothing if it fails: a test can tell a wrong skip that only lost the way apart)
  void encode_piece_mode(const uint8_t* p, size_t n, int mode, std::vector<uint32_t>& out) const {
    const uint8_t* end = p + n;
    if (mode == 0) return encode_piece(p, n, end, out, piece_cache());
    if (mode == 4) {
      if (linear().ok()) linear().encode(p, n, out);
      return;
    }
    if (mode == 1 && n < kSmallPiece) return merge_small(V_, p, n, end, out);
    if (mode == 3 && linear().ok() && linear().encode(p, n, out)) return;
    merge_heap(V_, p, n, end, out);
  }

  bool linear_ok() const { return linear().ok(); }

 private:
  static uint64_t next_serial() {
    static std::atomic<uint64_t> serial{0};
    return ++serial;
  }

  PieceCache& piece_cache() const {
    static thread_local PieceCache tl;
    if (tl.owner != serial_) {
      tl.small.reset();
      tl.large.reset();
      tl.owner = serial_;
    }
    return tl;
  }

  const LinearBpe& linear() const {
    std::call_once(linear_once_, [this] { linear_.build(V_); });
    return linear_;
  }

  // Pieces whose whole-token lookup missed: cache, then BPE.
  void encode_merged(const uint8_t* p, size_t n, const uint8_t* end, std::vector<uint32_t>& out,
                     PieceCache& pc) const {
    if (n <= decltype(pc.small)::kMaxKey) return cached_small(p, n, hash_bytes(p, n), end, out, pc);
    if (n <= decltype(pc.large)::kMaxKey) {
      uint64_t h = hash_bytes(p, n);
      size_t base = out.size();
      decltype(pc.large)::Slot* slot;
      if (pc.large.get(p, n, h, out, slot)) return;
      merge_small(V_, p, n, end, out);
      pc.large.put(slot, p, n, h, out.data() + base, out.size() - base);
      return;
    }
    if (n < kSmallPiece) return merge_small(V_, p, n, end, out);
    if (linear().ok() && linear().encode(p, n, out)) return;
    merge_heap(V_, p, n, end, out);
  }

  // A piece of up to 22 bytes through the small cache tier; any well-mixed hash of its bytes will
  // do (a piece hashed two ways may be cached twice, never wrongly: hits compare the bytes).
  void cached_small(const uint8_t* p, size_t n, uint64_t h, const uint8_t* end, std::vector<uint32_t>& out,
                    PieceCache& pc) const {
    size_t base = out.size();
    decltype(pc.small)::Slot* slot;
    if (pc.small.get(p, n, h, out, slot)) return;
    merge_small(V_, p, n, end, out);
    pc.small.put(slot, p, n, h, out.data() + base, out.size() - base);
  }

  void encode_piece(const uint8_t* p, size_t n, const uint8_t* end, std::vector<uint32_t>& out,
                    PieceCache& pc) const {
    if (n == 1) {
      out.push_back(V_.byte_rank(*p));
      return;
    }
    if (n <= V_.max_token_len()) {
      uint32_t id = V_.find(p, n, end);
      if (id != kNone) {
        out.push_back(id);
        return;
      }
    }
    encode_merged(p, n, end, out, pc);
  }

  // Leftmost allowed special token at or after pos (longest on ties); ms = n if none.
  void find_special(const uint8_t* s, size_t n, size_t pos, const uint8_t* allowed, size_t* next_at,
                    size_t& ms, size_t& mk) const {
    const size_t nf = first_bytes_.size();
    for (size_t i = pos; i < n;) {
      size_t cand = n;
      if (nf <= 8) {  // memchr per distinct first byte, each result reused until passed
        for (size_t f = 0; f < nf; ++f) {
          if (next_at[f] == SIZE_MAX || next_at[f] < i) {
            const void* hit = std::memchr(s + i, first_bytes_[f], n - i);
            next_at[f] = hit ? size_t(static_cast<const uint8_t*>(hit) - s) : n;
          }
          cand = std::min(cand, next_at[f]);
        }
      } else {
        cand = i;
        while (cand < n && !first_byte_[s[cand]]) ++cand;
      }
      if (cand >= n) break;
      for (uint32_t k : by_first_[s[cand]]) {
        const std::string& t = specials_[k].text;
        if (allowed[k] && t.size() <= n - cand && std::memcmp(s + cand, t.data(), t.size()) == 0) {
          ms = cand;
          mk = k;
          return;
        }
      }
      i = cand + 1;
    }
    ms = n;
  }

  Vocab V_;
  std::vector<SpecialToken> specials_;
  std::unordered_map<uint32_t, uint32_t> by_id_;
  uint8_t first_byte_[256];
  std::vector<uint8_t> first_bytes_;
  std::vector<uint32_t> by_first_[256];
  bool cuts_;
  mutable SegmentCache seg_cache_;
  size_t cache_min_bytes_;
  uint64_t serial_;
  mutable std::once_flag linear_once_;
  mutable LinearBpe linear_;
  std::thread builder_;
};

}  // namespace k3tok
