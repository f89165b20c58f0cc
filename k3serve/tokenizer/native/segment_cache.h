// Bounded, exact cache from a segment's text (+ its allow-special flag) to its token ids.
// A hit compares the full text, so results never depend on hash collisions; memory is bounded by
// an LRU over (text bytes + 4 bytes per id + overhead). Thread-safe.
#pragma once
#include <cstdint>
#include <cstring>
#include <list>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace k3tok {

class SegmentCache {
 public:
  struct Stats {
    size_t hits, misses, entries, bytes, capacity;
  };

  explicit SegmentCache(size_t capacity_bytes) : capacity_(capacity_bytes) {}

  // Appends the cached ids to out and returns true on a hit.
  bool lookup(uint64_t h, bool allow, const uint8_t* s, size_t n, std::vector<uint32_t>& out) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = map_.find(key(h, allow));
    if (it == map_.end() || it->second.allow != allow || it->second.text.size() != n ||
        std::memcmp(it->second.text.data(), s, n) != 0) {
      ++misses_;
      return false;
    }
    ++hits_;
    lru_.splice(lru_.begin(), lru_, it->second.lru);
    out.insert(out.end(), it->second.ids.begin(), it->second.ids.end());
    return true;
  }

  void insert(uint64_t h, bool allow, const uint8_t* s, size_t n, const uint32_t* ids, size_t k) {
    size_t cost = n + 4 * k + kOverhead;
    if (cost > capacity_) return;
    std::lock_guard<std::mutex> g(mu_);
    uint64_t kk = key(h, allow);
    auto it = map_.find(kk);
    if (it != map_.end()) erase(it);  // another thread's copy, or a hash collision: replace
    while (bytes_ + cost > capacity_ && !lru_.empty()) erase(map_.find(lru_.back()));
    lru_.push_front(kk);
    Entry& e = map_[kk];
    e.text.assign(reinterpret_cast<const char*>(s), n);
    e.allow = allow;
    e.ids.assign(ids, ids + k);
    e.lru = lru_.begin();
    e.cost = cost;
    bytes_ += cost;
  }

  void clear() {
    std::lock_guard<std::mutex> g(mu_);
    map_.clear();
    lru_.clear();
    bytes_ = 0;
  }

  Stats stats() {
    std::lock_guard<std::mutex> g(mu_);
    return Stats{hits_, misses_, map_.size(), bytes_, capacity_};
  }

 private:
  static constexpr size_t kOverhead = 128;
  struct Entry {
    std::string text;
    bool allow = false;
    std::vector<uint32_t> ids;
    std::list<uint64_t>::iterator lru;
    size_t cost = 0;
  };
  static uint64_t key(uint64_t h, bool allow) { return h ^ (allow ? 0x5bd1e9955bd1e995ull : 0); }

  void erase(std::unordered_map<uint64_t, Entry>::iterator it) {
    bytes_ -= it->second.cost;
    lru_.erase(it->second.lru);
    map_.erase(it);
  }

  size_t capacity_;
  size_t bytes_ = 0, hits_ = 0, misses_ = 0;
  std::unordered_map<uint64_t, Entry> map_;
  std::list<uint64_t> lru_;
  std::mutex mu_;
};

}  // namespace k3tok
