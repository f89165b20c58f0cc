// Pair checks of the linear encoder (linear_bpe.h) for tokens of up to three bytes, from the bytes.
//
// valid_short answers pairs of one- and two-byte tokens (3/4 of the checks on random letters) in
// closed form. valid answers pairs with a three-byte token (most of the rest): the general check
// reads the split records of both tokens and looks each unwound pair up in the 256 KiB filter and
// the 2 MiB merge table, and three quarters of those lookups ask for a three-byte token. Here every
// split and every such lookup comes from the bytes around the boundary: a token of one byte is a
// base token, one of two bytes splits into its bytes, one of three bytes splits after its first or
// second byte (a bit per token, in a table indexed by its bytes like the trie's third-byte table,
// so the ranges common text uses stay hot), and the merge of two parts that make three bytes is the
// three-byte token, if its split is that one. Only merges into four or more bytes are still looked
// up (`hashed`). The unwinding order is that of LinearBpe::valid_pair.
#pragma once
#include <cstdint>

#include "prefix_trie.h"
#include "vocab.h"

namespace k3tok {

class SmallPairs {
 public:
  // split(id) -> (left, right): the pair BPE merges into id (left == right == id: a base token).
  // valid_short stays off (short_ok() false) unless the byte tokens are ranks 0..255, base tokens,
  // and the two-byte tokens split into their bytes; valid and the splits of three-byte tokens (ok()
  // false) unless, too, every three-byte token splits into a two-byte token and a byte.
  template <class SplitOf>
  void build(const Vocab& V, const PrefixTrie& trie, SplitOf split) {
    trie_ = &trie;
    short_ok_ = ok_ = false;
    for (int c = 0; c < 256; ++c)
      if (trie.byte_tok(uint8_t(c)) >= 256) return;
    split3_.assign(size_t(1) << 19, 0);
    bool three = true;
    for (uint32_t id = 0; id < V.size(); ++id) {
      if (!V.has(id) || V.len(id) > 3) continue;
      const uint8_t* s = V.bytes(id);
      const auto sp = split(id);
      if (V.len(id) == 1) {
        if (sp.first != id || sp.second != id) return;
        continue;
      }
      const uint32_t x = trie.byte_tok(s[0]), y = trie.byte_tok(s[1]);
      if (V.len(id) == 2) {
        if (sp.first != x || sp.second != y) return;
        continue;
      }
      const uint32_t z = trie.byte_tok(s[2]);
      const bool l = sp.first == trie.token2(s) && sp.second == z;
      if (!l && !(sp.first == x && sp.second == trie.token2(s + 1))) three = false;
      split3_[word(s, l)] |= uint64_t(1) << (index(s) & 63);
    }
    short_ok_ = true;
    ok_ = three;
  }

  bool short_ok() const { return short_ok_; }
  bool ok() const { return ok_; }

  // Could BPE put token b (lb bytes from `at`) right after token a (la bytes before `at`), both of
  // one or two bytes, where a merges only with `partner` (into `merged`) among the tokens that can
  // follow it? Their splits are their bytes, so valid_pair's unwinding is fixed by the lengths and
  // the ranks: with a = x y and b = z w, the pair is invalid if a merges with b or, before b forms,
  // with z (both from the partner); if y z merges before a forms (or, when b is the later merge,
  // before b forms); or, when a is the later merge, if y merges with b before a forms. One-byte
  // tokens drop the steps that would unwind them.
  bool valid_short(uint32_t a, uint32_t la, uint32_t b, uint32_t lb, const uint8_t* at, uint32_t partner,
                   uint32_t merged, const uint32_t* pair2) const {
    if (b == partner) return false;  // a and b merge
    if (la == 1 && lb == 1) return true;
    const uint32_t z = trie_->byte_tok(at[0]);
    const uint32_t az = z == partner ? merged : kNone;  // a merged with z
    if (la == 1) return !(az <= b);                      // before b formed
    const uint32_t y = trie_->byte_tok(at[-1]);
    const uint32_t yz = pair2[(y << 8) | z];
    if (lb == 1) return !(yz < a);  // y and z merge before a forms
    if (a <= b) return !(az <= b) && !(yz < a);
    if (yz <= b) return false;
    // y merges with b before a forms? As y z merges after b, that merge is the token y b, if any
    return !(trie_->token3(at - 1) < a);
  }

  // The token of len (2 or 3) bytes at s splits after left_len bytes; token_at: its parts.
  uint32_t left_len(const uint8_t* s, uint32_t len) const { return len == 3 && left3(s) ? 2 : 1; }
  uint32_t token_at(const uint8_t* s, uint32_t len) const {
    return len == 1 ? trie_->byte_tok(s[0]) : trie_->token2(s);
  }

  // Could BPE put token b (lb bytes from `at`) right after token a (la bytes before `at`), where
  // a merges only with `partner` (into `merged`) among the tokens that can follow it? la, lb <= 3.
  // pair2: the merges of two byte tokens; hashed(x, y): the merge of tokens x and y, or kNone.
  // (Forced inline: the linear encoder has two copies of its loop, and GCC kept this out of both.)
  template <class Hashed>
  __attribute__((always_inline)) bool valid(uint32_t a, uint32_t la, uint32_t b, uint32_t lb, const uint8_t* at,
                                            uint32_t partner, uint32_t merged, const uint32_t* pair2,
                                            Hashed&& hashed) const {
    // while a is whole its merges are known: unwind b (as valid_pair does) until a must unwind
    uint32_t limit = kNone;
    for (;;) {
      const uint32_t m = b == partner ? merged : kNone;
      if (m < limit) return false;
      if (a > b) {
        limit = a;
        if (la > 1) break;
        // a is a byte and b a smaller one: nothing left to unwind
        return true;
      }
      limit = b + 1;
      if (lb == 1) {  // b is a byte: unwind a instead
        limit = a;
        if (la == 1) return true;
        break;
      }
      b = left(lb, at);
    }
    right(a, la, at);
    for (;;) {
      const uint32_t m = merge(a, la, b, lb, at, pair2, hashed);
      if (m < limit) return false;
      if (a > b) {
        limit = a;
        if (la > 1) {
          right(a, la, at);
        } else {  // a is a base token: unwind b instead
          limit = b + 1;
          if (lb == 1) return true;
          b = left(lb, at);
        }
      } else {
        limit = b + 1;
        if (lb > 1) {
          b = left(lb, at);
        } else {  // b is a base token: unwind a instead
          limit = a;
          if (la == 1) return true;
          right(a, la, at);
        }
      }
    }
  }

 private:
  static uint32_t index(const uint8_t* s) { return (uint32_t(s[0]) << 16) | (uint32_t(s[1]) << 8) | s[2]; }
  // the word of split3_ for the three bytes at s, and a split after the first two (l) or first one
  // (by the third byte's quarter first, so that the words of the text's two-byte prefixes lie
  // together: 11 KiB of cache lines for lowercase letters, not 43)
  static uint32_t word(const uint8_t* s, bool l) {
    return (uint32_t(s[2] >> 6) << 17) | (((uint32_t(s[0]) << 8) | s[1]) << 1) | uint32_t(l);
  }
  // there is a token of the three bytes at s, and it splits after the first two (l) or first one
  bool split3(const uint8_t* s, bool l) const { return (split3_[word(s, l)] >> (index(s) & 63)) & 1; }
  // the three-byte token at s (which exists) is its first two bytes' token merged with the third
  bool left3(const uint8_t* s) const { return split3(s, true); }

  // The left part of b (lb bytes from at); lb becomes its length.
  uint32_t left(uint32_t& lb, const uint8_t* at) const {
    if (lb == 3 && left3(at)) {
      lb = 2;
      return trie_->token2(at);
    }
    lb = 1;
    return trie_->byte_tok(at[0]);
  }

  // a (la bytes before at) becomes its right part.
  void right(uint32_t& a, uint32_t& la, const uint8_t* at) const {
    if (la == 3 && !left3(at - 3)) {
      la = 2;
      a = trie_->token2(at - 2);
      return;
    }
    la = 1;
    a = trie_->byte_tok(at[-1]);
  }

  // The merge of a (la bytes before at) with b (lb bytes from at), or kNone.
  template <class Hashed>
  uint32_t merge(uint32_t a, uint32_t la, uint32_t b, uint32_t lb, const uint8_t* at, const uint32_t* pair2,
                 Hashed& hashed) const {
    const uint32_t n = la + lb;
    if (n == 2) return pair2[(a << 8) | b];
    if (n > 3) return hashed(a, b);
    const uint8_t* s = at - la;
    return split3(s, la == 2) ? trie_->token3_known(s) : kNone;
  }

  const PrefixTrie* trie_ = nullptr;
  bool short_ok_ = false, ok_ = false;
  // two bits per three bytes x y z (see word): there is a token x y z and it splits into (x y, z),
  // or into (x, y z); indexed by the bytes so that the ranges text uses stay in cache
  HugeArray<uint64_t> split3_;
};

}  // namespace k3tok
