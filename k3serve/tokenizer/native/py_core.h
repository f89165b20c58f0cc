// The Python-facing tokenizer object: argument checking, the GIL released around the native encoder,
// the segment cache, the batch thread pool and the test hooks.
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core.h"
#include "py_decode.h"
#include "py_text.h"
#include "thread_pool.h"
#include "tiktoken_file.h"

namespace k3tok {

namespace py = pybind11;

class PyCore {
 public:
  PyCore(std::vector<std::pair<std::string, uint32_t>>&& tokens, const py::list& specials, bool cuts,
         size_t cache_bytes, size_t cache_min_bytes) {
    Vocab v;
    try {
      v.build(std::move(tokens));
    } catch (const std::invalid_argument& e) {
      throw py::value_error(e.what());
    }
    std::vector<SpecialToken> sp;
    for (py::handle item : specials) {
      auto t = item.cast<py::tuple>();
      sp.push_back(SpecialToken{t[0].cast<std::string>(), t[1].cast<uint32_t>()});
    }
    try {
      core_ = std::make_unique<Core>(std::move(v), std::move(sp), cuts, cache_bytes, cache_min_bytes);
    } catch (const std::invalid_argument& e) {
      throw py::value_error(e.what());
    }
    for (uint32_t k = 0; k < core_->specials().size(); ++k) index_[core_->specials()[k].text] = k;
    all_.assign(core_->specials().size(), 1);
  }

  static PyCore from_tiktoken(py::bytes data, const py::list& specials, bool cuts, size_t cache_bytes,
                              size_t cache_min_bytes) {
    std::string_view d = data;
    return PyCore(parse_tiktoken(d), specials, cuts, cache_bytes, cache_min_bytes);
  }

  static PyCore from_ranks(const py::dict& ranks, const py::list& specials, bool cuts, size_t cache_bytes,
                           size_t cache_min_bytes) {
    std::vector<std::pair<std::string, uint32_t>> tokens;
    tokens.reserve(ranks.size());
    for (auto kv : ranks) {
      if (!PyBytes_Check(kv.first.ptr())) throw py::type_error("mergeable_ranks keys must be bytes");
      tokens.emplace_back(kv.first.cast<std::string>(), kv.second.cast<uint32_t>());
    }
    return PyCore(std::move(tokens), specials, cuts, cache_bytes, cache_min_bytes);
  }

  // allowed: None (no specials), True (all), or a list of special-token texts.
  std::vector<uint8_t> parse_allowed(py::handle allowed) const {
    if (allowed.is_none()) return {};
    if (PyBool_Check(allowed.ptr())) return allowed.ptr() == Py_True ? all_ : std::vector<uint8_t>{};
    std::vector<uint8_t> mask(all_.size(), 0);
    for (py::handle name : allowed) {
      auto it = index_.find(py::cast<std::string>(name));
      if (it == index_.end()) throw py::value_error("not a special token: " + py::cast<std::string>(py::repr(name)));
      mask[it->second] = 1;
    }
    return mask;
  }

  static const uint8_t* mask_ptr(const std::vector<uint8_t>& m) {
    for (uint8_t b : m)
      if (b) return m.data();
    return nullptr;
  }

  py::array_t<uint32_t> encode(py::handle text, py::handle allowed) {
    Utf8Text t;
    utf8_of(text, "text", t);
    std::string_view s = t.view;
    std::vector<uint8_t> mask = parse_allowed(allowed);
    std::vector<uint32_t> out;
    {
      py::gil_scoped_release nogil;
      core_->encode(u8(s), s.size(), mask_ptr(mask), out);
    }
    return to_array(std::move(out));
  }

  size_t count(py::handle text, py::handle allowed) {
    Utf8Text t;
    utf8_of(text, "text", t);
    std::string_view s = t.view;
    std::vector<uint8_t> mask = parse_allowed(allowed);
    py::gil_scoped_release nogil;
    thread_local std::vector<uint32_t> buf;
    buf.clear();
    core_->encode(u8(s), s.size(), mask_ptr(mask), buf);
    size_t k = buf.size();
    if (buf.capacity() > (size_t(1) << 22)) std::vector<uint32_t>().swap(buf);
    return k;
  }

  // segments: sequence of (text, allow_special) pairs. Segments of at least cache_min_bytes go
  // through the segment cache when use_cache is true.
  py::array_t<uint32_t> encode_segments(const py::sequence& segments, bool use_cache) {
    struct Seg {
      Utf8Text utf8;
      bool allow;
    };
    std::vector<Seg> segs(segments.size());  // sized once: views into `owned` stay valid
    for (size_t i = 0; i < segments.size(); ++i) {
      py::handle item = segments[i];
      if (!(PyTuple_Check(item.ptr()) || PyList_Check(item.ptr())) || py::len(item) != 2)
        throw py::type_error("segments[" + std::to_string(i) + "] must be a (text, allow_special) pair");
      py::object t = item[py::int_(0)], a = item[py::int_(1)];
      if (!PyBool_Check(a.ptr()))
        throw py::type_error("segments[" + std::to_string(i) + "][1] (allow_special) must be bool");
      utf8_of(t, ("segments[" + std::to_string(i) + "][0]").c_str(), segs[i].utf8);
      segs[i].allow = a.ptr() == Py_True;
    }
    std::vector<uint32_t> out;
    {
      py::gil_scoped_release nogil;
      const uint8_t* all = mask_ptr(all_);
      SegmentCache& cache = core_->segment_cache();
      std::vector<uint32_t> tmp;
      for (const Seg& seg : segs) {
        const uint8_t* allow = seg.allow ? all : nullptr;
        struct {
          std::string_view text;
          bool allow;
        } sg{seg.utf8.view, seg.allow};
        if (!use_cache || sg.text.size() < core_->cache_min_bytes()) {
          core_->encode(u8(sg.text), sg.text.size(), allow, out);
          continue;
        }
        uint64_t h = hash_bytes(u8(sg.text), sg.text.size());
        if (cache.lookup(h, sg.allow, u8(sg.text), sg.text.size(), out)) continue;
        tmp.clear();
        core_->encode(u8(sg.text), sg.text.size(), allow, tmp);
        cache.insert(h, sg.allow, u8(sg.text), sg.text.size(), tmp.data(), tmp.size());
        out.insert(out.end(), tmp.begin(), tmp.end());
      }
    }
    return to_array(std::move(out));
  }

  // Each text is converted to UTF-8 and encoded on the pool (the str objects are immutable and
  // kept alive by `objs`, so no GIL is needed to read them). Every item encodes into its own local
  // vector, moved into place once: two threads appending to adjacent vector headers would share a
  // cache line on every token.
  py::list encode_batch(const py::sequence& texts, py::handle allowed, size_t n_threads) {
    const size_t n = texts.size();
    std::vector<py::object> objs(n);
    for (size_t i = 0; i < n; ++i) {
      objs[i] = texts[i];
      PyObject* o = objs[i].ptr();
      if (!PyUnicode_Check(o))
        throw py::type_error("texts[" + std::to_string(i) + "] must be str, not " + Py_TYPE(o)->tp_name);
#if PY_VERSION_HEX < 0x030C0000
      if (PyUnicode_READY(o) != 0) throw py::error_already_set();
#endif
    }
    std::vector<uint8_t> mask = parse_allowed(allowed);
    const uint8_t* m = mask_ptr(mask);
    std::vector<std::vector<uint32_t>> outs(n);
    std::vector<uint8_t> bad(n, 0);  // a lone surrogate: raised below, with the GIL
    if (n_threads == 0) n_threads = std::max(1u, std::thread::hardware_concurrency());
    {
      py::gil_scoped_release nogil;
      ThreadPool::get().run(n_threads, n, [&](size_t i) {
        PyObject* o = objs[i].ptr();
        const size_t len = size_t(PyUnicode_GET_LENGTH(o));
        std::string_view view;
        thread_local Utf8Buf owned;
        bool ok = true;
        if (PyUnicode_IS_ASCII(o)) {
          view = std::string_view(static_cast<const char*>(PyUnicode_DATA(o)), len);
        } else {
          switch (PyUnicode_KIND(o)) {
            case PyUnicode_1BYTE_KIND: ok = encode_utf8(PyUnicode_1BYTE_DATA(o), len, owned); break;
            case PyUnicode_2BYTE_KIND: ok = encode_utf8(PyUnicode_2BYTE_DATA(o), len, owned); break;
            default: ok = encode_utf8(PyUnicode_4BYTE_DATA(o), len, owned); break;
          }
          view = owned.view();
        }
        if (!ok) {
          bad[i] = 1;
          return;
        }
        std::vector<uint32_t> ids;
        core_->encode(u8(view), view.size(), m, ids);
        outs[i] = std::move(ids);
        owned.release_if_over(size_t(1) << 24);
      });
    }
    for (size_t i = 0; i < n; ++i)
      if (bad[i]) {  // let CPython raise its UnicodeEncodeError
        Utf8Text t;
        utf8_of(objs[i], ("texts[" + std::to_string(i) + "]").c_str(), t);
      }
    py::list result(n);
    for (size_t i = 0; i < n; ++i) result[i] = to_array(std::move(outs[i]));
    return result;
  }
  py::bytes decode_bytes(py::handle ids) { return k3tok::decode_bytes(*core_, ids); }
  py::object token_bytes(long long id) { return k3tok::token_bytes(*core_, id); }

  // Test hooks.
  py::list pieces(py::handle text, bool cuts) {
    Utf8Text t;
    utf8_of(text, "text", t);
    std::string_view s = t.view;
    py::list out;
    auto emit_chunk = [&](size_t a, size_t b) {
      pretokenize(u8(s) + a, b - a, [&](size_t i, size_t e) {
        out.append(py::str(s.data() + a + i, e - i));
      });
    };
    if (cuts)
      kimi_cuts(u8(s), s.size(), emit_chunk);
    else
      emit_chunk(0, s.size());
    return out;
  }

  py::list cut_parts(py::handle text) {
    Utf8Text t;
    utf8_of(text, "text", t);
    std::string_view s = t.view;
    py::list out;
    kimi_cuts(u8(s), s.size(), [&](size_t a, size_t b) { out.append(py::str(s.data() + a, b - a)); });
    return out;
  }

  py::array_t<uint32_t> bpe(py::bytes piece, int mode) {
    std::string p = piece;
    if (p.empty()) return to_array({});
    std::vector<uint32_t> out;
    {
      py::gil_scoped_release nogil;
      core_->encode_piece_mode(reinterpret_cast<const uint8_t*>(p.data()), p.size(), mode, out);
    }
    return to_array(std::move(out));
  }

  bool linear_ok() {
    py::gil_scoped_release nogil;
    return core_->linear_ok();
  }

  py::dict cache_stats() {
    SegmentCache::Stats s = core_->segment_cache().stats();
    py::dict d;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    d["entries"] = s.entries;
    d["bytes"] = s.bytes;
    d["capacity_bytes"] = s.capacity;
    return d;
  }

  void cache_clear() { core_->segment_cache().clear(); }
  void prebuild() { core_->prebuild(); }
  size_t n_ranks() const { return core_->vocab().size(); }

 private:
  std::unique_ptr<Core> core_;
  std::unordered_map<std::string, uint32_t> index_;
  std::vector<uint8_t> all_;
};

}  // namespace k3tok
