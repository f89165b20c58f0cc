// Per-code-point class flags for the Kimi pre-tokenizer, built once from the generated ranges.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <vector>

#include "unicode_tables.h"

namespace k3tok {

enum : uint16_t {
  kHan = 1,        // \p{Han}
  kLetter = 2,     // \p{L}
  kNumber = 4,     // \p{N}
  kUpper = 8,      // [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]
  kLower = 16,     // [\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]
  kWs = 32,        // \s
  kPySpace = 64,   // Python str.isspace (the 25k cut)
  kPrefix = 128,   // [^\r\n\p{L}\p{N}]
  kPunct = 256,    // [^\s\p{L}\p{N}]
};

class CharClasses {
 public:
  static const CharClasses& get() {
    static const CharClasses instance;
    return instance;
  }
  uint16_t of(uint32_t cp) const { return blocks_[(size_t(index_[cp >> 8]) << 8) | (cp & 0xFF)]; }
  uint16_t ascii(uint8_t b) const { return ascii_[b]; }

 private:
  template <size_t N>
  static void mark(std::vector<uint16_t>& flat, const CpRange (&ranges)[N], uint16_t flag) {
    for (const CpRange& r : ranges)
      for (uint32_t c = r.lo; c <= r.hi; ++c) flat[c] |= flag;
  }

  CharClasses() {
    std::vector<uint16_t> flat(0x110000, 0);
    mark(flat, kRangesHAN, kHan);
    mark(flat, kRangesL, kLetter);
    mark(flat, kRangesN, kNumber);
    mark(flat, kRangesUPPER, kUpper);
    mark(flat, kRangesLOWER, kLower);
    mark(flat, kRangesWS, kWs);
    mark(flat, kRangesPYSPACE, kPySpace);
    for (uint32_t c = 0; c < 0x110000; ++c) {
      uint16_t f = flat[c];
      if (!(f & (kLetter | kNumber)) && c != '\r' && c != '\n') f |= kPrefix;
      if (!(f & (kLetter | kNumber | kWs))) f |= kPunct;
      flat[c] = f;
    }
    // two-stage table: identical 256-entry blocks are stored once
    std::map<std::vector<uint16_t>, uint16_t> seen;
    index_.resize(0x110000 >> 8);
    for (uint32_t b = 0; b < (0x110000 >> 8); ++b) {
      std::vector<uint16_t> block(flat.begin() + (b << 8), flat.begin() + ((b + 1) << 8));
      auto it = seen.find(block);
      if (it == seen.end()) {
        it = seen.emplace(block, uint16_t(blocks_.size() >> 8)).first;
        blocks_.insert(blocks_.end(), block.begin(), block.end());
      }
      index_[b] = it->second;
    }
    for (int c = 0; c < 128; ++c) ascii_[c] = flat[c];
  }

  std::vector<uint16_t> index_;
  std::vector<uint16_t> blocks_;
  uint16_t ascii_[128];
};

// Decodes one code point of valid UTF-8 (the input always comes from a Python str).
inline uint32_t decode_utf8(const uint8_t* p, uint32_t& len) {
  uint8_t b = p[0];
  if (b < 0x80) {
    len = 1;
    return b;
  }
  if (b < 0xE0) {
    len = 2;
    return (uint32_t(b & 0x1F) << 6) | (p[1] & 0x3F);
  }
  if (b < 0xF0) {
    len = 3;
    return (uint32_t(b & 0x0F) << 12) | (uint32_t(p[1] & 0x3F) << 6) | (p[2] & 0x3F);
  }
  len = 4;
  return (uint32_t(b & 0x07) << 18) | (uint32_t(p[1] & 0x3F) << 12) | (uint32_t(p[2] & 0x3F) << 6) |
         (p[3] & 0x3F);
}

inline uint16_t class_at(const CharClasses& C, const uint8_t* p, uint32_t& len) {
  if (p[0] < 0x80) {
    len = 1;
    return C.ascii(p[0]);
  }
  return C.of(decode_utf8(p, len));
}

}  // namespace k3tok
