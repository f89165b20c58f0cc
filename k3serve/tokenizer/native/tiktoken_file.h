// The tiktoken vocabulary file format: one "base64(token bytes) rank" per line.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "vocab.h"

namespace k3tok {

namespace py = pybind11;

inline int b64_value(uint8_t c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

inline std::string b64_decode(std::string_view s, size_t line) {
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char ch : s) {
    if (ch == '=') break;
    int v = b64_value(uint8_t(ch));
    if (v < 0) throw py::value_error("tiktoken file line " + std::to_string(line) + ": invalid base64");
    acc = (acc << 6) | uint32_t(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(char((acc >> bits) & 0xFF));
    }
  }
  return out;
}

// "base64 rank" per line, as tiktoken's load_tiktoken_bpe reads it.
inline std::vector<std::pair<std::string, uint32_t>> parse_tiktoken(std::string_view data) {
  std::vector<std::pair<std::string, uint32_t>> tokens;
  size_t line = 0;
  for (size_t pos = 0; pos < data.size();) {
    size_t eol = data.find('\n', pos);
    if (eol == std::string_view::npos) eol = data.size();
    std::string_view ln = data.substr(pos, eol - pos);
    pos = eol + 1;
    ++line;
    while (!ln.empty() && (ln.back() == '\r' || ln.back() == ' ')) ln.remove_suffix(1);
    if (ln.empty()) continue;
    size_t sp = ln.find(' ');
    if (sp == std::string_view::npos)
      throw py::value_error("tiktoken file line " + std::to_string(line) + ": expected 'base64 rank'");
    std::string_view rank_s = ln.substr(sp + 1);
    uint64_t rank = 0;
    if (rank_s.empty() || rank_s.size() > 10)
      throw py::value_error("tiktoken file line " + std::to_string(line) + ": bad rank");
    for (char c : rank_s) {
      if (c < '0' || c > '9') throw py::value_error("tiktoken file line " + std::to_string(line) + ": bad rank");
      rank = rank * 10 + uint64_t(c - '0');
    }
    if (rank >= kNone) throw py::value_error("tiktoken file line " + std::to_string(line) + ": rank too large");
    tokens.emplace_back(b64_decode(ln.substr(0, sp), line), uint32_t(rank));
  }
  return tokens;
}

}  // namespace k3tok
