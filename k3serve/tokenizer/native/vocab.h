// Vocabulary: token bytes by id and a flat open-addressing table from bytes to id.
// Each slot keeps the token's first 24 bytes inline, so a lookup is one cache line.
#pragma once
#include <sys/mman.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace k3tok {

constexpr uint32_t kNone = 0xFFFFFFFFu;

inline uint64_t mix64(uint64_t x) {
  x ^= x >> 32;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 32;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 32;
  return x;
}

// Fast non-cryptographic hash of a byte string (piece and segment cache keys).
inline uint64_t hash_bytes(const uint8_t* p, size_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xC2B2AE3D27D4EB4Full);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * 0x9FB21C651E98DF25ull;
    h ^= h >> 29;
  }
  if (i < n) {
    uint64_t w = 0;
    std::memcpy(&w, p + i, n - i);
    h = (h ^ w) * 0x9FB21C651E98DF25ull;
  }
  return mix64(h);
}

// memcmp(a, b, n) == 0 without a library call for the short strings of the hot path.
inline bool bytes_equal(const uint8_t* a, const uint8_t* b, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t x, y;
    std::memcpy(&x, a + i, 8);
    std::memcpy(&y, b + i, 8);
    if (x != y) return false;
  }
  for (; i < n; ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// A power-of-two array of T that asks for transparent huge pages (one TLB entry covers 2 MiB of
// the hash table, which is probed at random).
template <class T>
class HugeArray {
 public:
  HugeArray() = default;
  HugeArray(const HugeArray&) = delete;
  HugeArray& operator=(const HugeArray&) = delete;
  HugeArray(HugeArray&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr; o.n_ = 0; }
  HugeArray& operator=(HugeArray&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  ~HugeArray() { std::free(p_); }
  void assign(size_t n, const T& v) {
    std::free(p_);
    size_t bytes = std::max<size_t>(n * sizeof(T), 4096);
    size_t align = bytes >= (size_t(2) << 20) ? (size_t(2) << 20) : 4096;
    bytes = (bytes + align - 1) / align * align;
    p_ = static_cast<T*>(std::aligned_alloc(align, bytes));
    if (!p_) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
    if (align > 4096) madvise(p_, bytes, MADV_HUGEPAGE);
#endif
    n_ = n;
    for (size_t i = 0; i < n; ++i) p_[i] = v;
  }
  T& operator[](size_t i) { return p_[i]; }
  const T& operator[](size_t i) const { return p_[i]; }
  size_t size() const { return n_; }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

// keep[len][j]: mask of the bytes of word j that lie inside a key of len bytes (len <= 24).
struct Keep24 {
  uint64_t m[25][3];
  constexpr Keep24() : m() {
    for (size_t len = 0; len <= 24; ++len)
      for (size_t j = 0; j < 3; ++j) {
        size_t b = len > 8 * j ? len - 8 * j : 0;
        m[len][j] = b >= 8 ? ~uint64_t(0) : (uint64_t(1) << (8 * b)) - 1;
      }
  }
};
inline constexpr Keep24 kKeep24{};

class Vocab {
 public:
  // tokens: (bytes, rank) pairs; ranks are the token ids and the BPE merge priorities.
  void build(std::vector<std::pair<std::string, uint32_t>>&& tokens) {
    uint32_t max_rank = 0;
    size_t total = 0;
    for (auto& t : tokens) {
      if (t.first.empty()) throw std::invalid_argument("vocabulary contains an empty token");
      max_rank = std::max(max_rank, t.second);
      total += t.first.size();
    }
    size_ = tokens.empty() ? 0 : size_t(max_rank) + 1;
    if (size_ >= kNone) throw std::invalid_argument("rank too large");
    off_.assign(size_ + 1, 0);
    len_.assign(size_, 0);
    arena_.reserve(total + 8);
    size_t cap = 16;
    while (cap < tokens.size() + tokens.size() / 2) cap <<= 1;  // load factor <= 2/3
    table_.assign(cap, Slot{{0, 0, 0}, 0, kNone});
    mask_ = cap - 1;
    shift_ = 64;
    for (size_t c = cap; c > 1; c >>= 1) --shift_;
    max_len_ = 0;
    for (auto& t : tokens) {
      uint32_t id = t.second;
      if (len_[id]) throw std::invalid_argument("duplicate rank " + std::to_string(id) + " in vocabulary");
      off_[id] = uint32_t(arena_.size());
      len_[id] = uint32_t(t.first.size());
      arena_ += t.first;
      max_len_ = std::max<size_t>(max_len_, t.first.size());
    }
    arena_.append(8, '\0');  // lookups of a token's own bytes may read 8 bytes past its end
    for (uint32_t id = 0; id < size_; ++id) {
      if (!len_[id]) continue;
      const uint8_t* p = bytes(id);
      if (find(p, len_[id], p + len_[id] + 8) != kNone)
        throw std::invalid_argument("duplicate token bytes in vocabulary (rank " + std::to_string(id) + ")");
      insert(p, len_[id], id);
    }
    for (int b = 0; b < 256; ++b) {
      uint8_t c = uint8_t(b);
      byte_rank_[b] = find(&c, 1, &c + 1);
      if (byte_rank_[b] == kNone)
        throw std::invalid_argument("vocabulary has no token for byte " + std::to_string(b) +
                                    " (byte-level BPE needs all 256)");
    }
  }

  // The key is the first 24 bytes, zero-padded (the whole token for 99.9% of Kimi's).
  struct Key {
    uint64_t w[3];
    uint64_t hash;
  };
  static Key key(const uint8_t* p, size_t len, const uint8_t* end) {
    Key k;
    if (len <= 8 && size_t(end - p) >= 8) {  // the common case: one word
      std::memcpy(&k.w[0], p, 8);
      k.w[0] &= len == 8 ? ~uint64_t(0) : (uint64_t(1) << (8 * len)) - 1;
      k.w[1] = k.w[2] = 0;
      k.hash = (k.w[0] ^ (uint64_t(len) << 58)) * 0x9E3779B97F4A7C15ull;
      return k;
    }
    if (size_t(end - p) >= 24) {  // whole words, then zero the bytes past len with masks
      std::memcpy(k.w, p, 24);
      auto keep = [](size_t bytes) { return bytes >= 8 ? ~uint64_t(0) : (uint64_t(1) << (8 * bytes)) - 1; };
      if (len <= 8) {
        k.w[0] &= keep(len);
        k.w[1] = k.w[2] = 0;
      } else if (len <= 16) {
        k.w[1] &= keep(len - 8);
        k.w[2] = 0;
      } else if (len < 24) {
        k.w[2] &= keep(len - 16);
      }
    } else {
      k.w[0] = k.w[1] = k.w[2] = 0;
      std::memcpy(k.w, p, len < 24 ? len : 24);
    }
    uint64_t x = k.w[0] ^ (uint64_t(len) << 58);
    if (len > 8) x ^= (k.w[1] * 0xC2B2AE3D27D4EB4Full) ^ (k.w[2] * 0x9FB21C651E98DF25ull);
    if (len > 24) {
      uint64_t tail;
      std::memcpy(&tail, p + len - 8, 8);
      x ^= tail * 0xD6E8FEB86659FD93ull;
    }
    k.hash = x * 0x9E3779B97F4A7C15ull;  // Fibonacci hashing: the slot index is the top bits
    return k;
  }
  // Pieces of 1..16 bytes (~95% of prose pieces) with 16 readable bytes at p: key24's key and
  // hash in two words (cheaper: digits and JSON lost ~10% to the third word and its multiply).
  static uint64_t key16(const uint8_t* p, size_t len, uint64_t& w0, uint64_t& w1) {
    const uint64_t* keep = kKeep24.m[len];
    std::memcpy(&w0, p, 8);
    std::memcpy(&w1, p + 8, 8);
    w0 &= keep[0];
    w1 &= keep[1];
    return (w0 ^ (uint64_t(len) << 58) ^ (w1 * 0xC2B2AE3D27D4EB4Full)) * 0x9E3779B97F4A7C15ull;
  }
  uint32_t find16(uint64_t h, uint64_t w0, uint64_t w1, size_t len) const {
    for (size_t i = h >> shift_;; i = (i + 1) & mask_) {
      const Slot& s = table_[i];
      // len <= 16: a slot of that length has a zero third word
      if (((s.w[0] ^ w0) | (s.w[1] ^ w1) | (s.len ^ len)) == 0) return s.id;
      if (s.id == kNone) return kNone;
    }
  }

  // Pieces of 1..24 bytes with 24 readable bytes at p: the same key and hash as key(), but with
  // no branch on the length, which is unpredictable from piece to piece.
  // (Plain words, not a Key: copying a Key through the stack stalls on store forwarding.)
  static uint64_t key24(const uint8_t* p, size_t len, uint64_t& w0, uint64_t& w1, uint64_t& w2) {
    const uint64_t* keep = kKeep24.m[len];
    std::memcpy(&w0, p, 8);
    std::memcpy(&w1, p + 8, 8);
    std::memcpy(&w2, p + 16, 8);
    w0 &= keep[0];
    w1 &= keep[1];
    w2 &= keep[2];
    uint64_t x = w0 ^ (uint64_t(len) << 58) ^ (w1 * 0xC2B2AE3D27D4EB4Full) ^ (w2 * 0x9FB21C651E98DF25ull);
    return x * 0x9E3779B97F4A7C15ull;
  }
  // h, w0..w2 from key24 (no tail to compare)
  uint32_t find24(uint64_t h, uint64_t w0, uint64_t w1, uint64_t w2, size_t len) const {
    for (size_t i = h >> shift_;; i = (i + 1) & mask_) {
      const Slot& s = table_[i];
      if (((s.w[0] ^ w0) | (s.w[1] ^ w1) | (s.w[2] ^ w2) | (s.len ^ len)) == 0) return s.id;
      if (s.id == kNone) return kNone;
    }
  }

  // Id of the token with exactly these bytes, or kNone. `end` bounds safe reads past p+len.
  uint32_t find(const uint8_t* p, size_t len, const uint8_t* end) const { return find(key(p, len, end), p, len); }

  uint32_t find(const Key& k, const uint8_t* p, size_t len) const {
    for (size_t i = k.hash >> shift_;; i = (i + 1) & mask_) {
      const Slot& s = table_[i];
      if (s.w[0] == k.w[0] && s.len == len && s.w[1] == k.w[1] && s.w[2] == k.w[2]) {
        if (len <= 24 || tail_equal(s.id, p, len)) return s.id;
      } else if (s.id == kNone) {
        return kNone;
      }
    }
  }

  uint32_t byte_rank(uint8_t b) const { return byte_rank_[b]; }
  size_t size() const { return size_; }  // max rank + 1
  size_t max_token_len() const { return max_len_; }
  bool has(uint32_t id) const { return id < size_ && len_[id] != 0; }
  const uint8_t* bytes(uint32_t id) const { return reinterpret_cast<const uint8_t*>(arena_.data()) + off_[id]; }
  uint32_t len(uint32_t id) const { return len_[id]; }

 private:
  // 32-byte slot, two per cache line: key bytes inline, so a hit touches nothing else.
  struct Slot {
    uint64_t w[3];
    uint32_t len;
    uint32_t id;  // kNone = empty
  };

  bool tail_equal(uint32_t id, const uint8_t* p, size_t len) const {
    return bytes_equal(reinterpret_cast<const uint8_t*>(arena_.data()) + off_[id] + 24, p + 24, len - 24);
  }

  void insert(const uint8_t* p, size_t len, uint32_t id) {
    Key k = key(p, len, p + len);
    size_t i = k.hash >> shift_;
    while (table_[i].id != kNone) i = (i + 1) & mask_;
    table_[i] = Slot{{k.w[0], k.w[1], k.w[2]}, uint32_t(len), id};
  }

  size_t size_ = 0, max_len_ = 0;
  std::string arena_;
  std::vector<uint32_t> off_, len_;
  HugeArray<Slot> table_;
  size_t mask_ = 0;
  int shift_ = 64;
  uint32_t byte_rank_[256];
};

}  // namespace k3tok
