// pybind11 bindings: k3serve.tokenizer._native. The GIL is released while encoding; outputs are
// numpy uint32 arrays that own their buffer (no Python list is built).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <cstdint>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "core.h"
#include "thread_pool.h"

namespace py = pybind11;
using namespace k3tok;

namespace {

// UTF-8 of a str. ASCII strings are used in place; others are converted here (faster than
// CPython's encoder on mostly-ASCII text, and nothing is cached on the str object). A lone
// surrogate makes CPython raise its UnicodeEncodeError, which the Python layer handles.
struct Utf8Text {
  std::string_view view;
  std::string owned;
};

template <class CharT>
bool encode_utf8(const CharT* s, size_t n, std::string& out) {
  out.resize(n * (sizeof(CharT) == 1 ? 2 : sizeof(CharT) == 2 ? 3 : 4));
  uint8_t* o = reinterpret_cast<uint8_t*>(&out[0]);
  uint8_t* const begin = o;
  size_t i = 0;
  while (i < n) {
#if defined(__SSE2__)
    if (sizeof(CharT) == 2 && i + 16 <= n) {  // 16 UTF-16 units, all ASCII: narrow them at once
      __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 8));
      __m128i high = _mm_and_si128(_mm_or_si128(a, b), _mm_set1_epi16(short(0xFF80)));
      if (_mm_movemask_epi8(_mm_cmpeq_epi16(high, _mm_setzero_si128())) == 0xFFFF) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm_packus_epi16(a, b));
        o += 16;
        i += 16;
        continue;
      }
    }
    if (sizeof(CharT) == 1 && i + 16 <= n) {
      __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      if (_mm_movemask_epi8(a) == 0) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o), a);
        o += 16;
        i += 16;
        continue;
      }
    }
#endif
    uint32_t c = s[i++];
    if (c < 0x80) {
      *o++ = uint8_t(c);
    } else if (c < 0x800) {
      *o++ = uint8_t(0xC0 | (c >> 6));
      *o++ = uint8_t(0x80 | (c & 0x3F));
    } else if (c < 0x10000) {
      if (c >= 0xD800 && c <= 0xDFFF) return false;
      *o++ = uint8_t(0xE0 | (c >> 12));
      *o++ = uint8_t(0x80 | ((c >> 6) & 0x3F));
      *o++ = uint8_t(0x80 | (c & 0x3F));
    } else {
      *o++ = uint8_t(0xF0 | (c >> 18));
      *o++ = uint8_t(0x80 | ((c >> 12) & 0x3F));
      *o++ = uint8_t(0x80 | ((c >> 6) & 0x3F));
      *o++ = uint8_t(0x80 | (c & 0x3F));
    }
  }
  out.resize(size_t(o - begin));
  return true;
}

void utf8_of(py::handle h, const char* what, Utf8Text& t) {
  PyObject* o = h.ptr();
  if (!PyUnicode_Check(o)) throw py::type_error(std::string(what) + " must be str, not " + Py_TYPE(o)->tp_name);
#if PY_VERSION_HEX < 0x030C0000
  if (PyUnicode_READY(o) != 0) throw py::error_already_set();  // legacy (wstr) strings
#endif
  size_t n = size_t(PyUnicode_GET_LENGTH(o));
  bool ok = true;
  if (PyUnicode_IS_ASCII(o)) {
    t.view = std::string_view(static_cast<const char*>(PyUnicode_DATA(o)), n);
    return;
  }
  switch (PyUnicode_KIND(o)) {
    case PyUnicode_1BYTE_KIND: ok = encode_utf8(PyUnicode_1BYTE_DATA(o), n, t.owned); break;
    case PyUnicode_2BYTE_KIND: ok = encode_utf8(PyUnicode_2BYTE_DATA(o), n, t.owned); break;
    default: ok = encode_utf8(PyUnicode_4BYTE_DATA(o), n, t.owned); break;
  }
  if (!ok) {  // lone surrogate: let CPython raise its UnicodeEncodeError
    Py_ssize_t len;
    if (!PyUnicode_AsUTF8AndSize(o, &len)) throw py::error_already_set();
    throw py::value_error("internal error: surrogate not rejected by CPython");
  }
  t.view = t.owned;
}

const uint8_t* u8(std::string_view v) { return reinterpret_cast<const uint8_t*>(v.data()); }

py::array_t<uint32_t> to_array(std::vector<uint32_t>&& v) {
  if (v.capacity() > 2 * v.size() + 64) v.shrink_to_fit();
  auto* owned = new std::vector<uint32_t>(std::move(v));
  py::capsule free_it(owned, [](void* p) { delete static_cast<std::vector<uint32_t>*>(p); });
  return py::array_t<uint32_t>({owned->size()}, {sizeof(uint32_t)}, owned->data(), free_it);
}

int b64_value(uint8_t c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

std::string b64_decode(std::string_view s, size_t line) {
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
std::vector<std::pair<std::string, uint32_t>> parse_tiktoken(std::string_view data) {
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
        thread_local std::string owned;
        bool ok = true;
        if (PyUnicode_IS_ASCII(o)) {
          view = std::string_view(static_cast<const char*>(PyUnicode_DATA(o)), len);
        } else {
          switch (PyUnicode_KIND(o)) {
            case PyUnicode_1BYTE_KIND: ok = encode_utf8(PyUnicode_1BYTE_DATA(o), len, owned); break;
            case PyUnicode_2BYTE_KIND: ok = encode_utf8(PyUnicode_2BYTE_DATA(o), len, owned); break;
            default: ok = encode_utf8(PyUnicode_4BYTE_DATA(o), len, owned); break;
          }
          view = owned;
        }
        if (!ok) {
          bad[i] = 1;
          return;
        }
        std::vector<uint32_t> ids;
        core_->encode(u8(view), view.size(), m, ids);
        outs[i] = std::move(ids);
        if (owned.capacity() > (size_t(1) << 24)) std::string().swap(owned);  // keep no huge buffer
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

  py::bytes decode_bytes(py::handle ids) {
    std::string out;
    auto add = [&](long long id) {
      if (id >= 0 && id < (long long)kNone) {
        uint32_t u = uint32_t(id);
        if (core_->vocab().has(u)) {
          out.append(reinterpret_cast<const char*>(core_->vocab().bytes(u)), core_->vocab().len(u));
          return;
        }
        long k = core_->special_index(u);
        if (k >= 0) {
          out += core_->specials()[size_t(k)].text;
          return;
        }
      }
      throw py::value_error("invalid token id " + std::to_string(id) + " (not in the vocabulary)");
    };
    if (py::isinstance<py::array>(ids)) {
      py::array arr = py::reinterpret_borrow<py::array>(ids);
      char kind = arr.dtype().kind();
      if (arr.size() && kind != 'i' && kind != 'u')
        throw py::type_error("token ids must be integers, got an array of dtype " +
                             std::string(py::str(arr.dtype())));
      auto a = py::array_t<long long, py::array::c_style | py::array::forcecast>::ensure(arr);
      if (kind == 'u' && arr.itemsize() == 8) {  // uint64 beyond int64 would wrap
        auto u = py::array_t<unsigned long long, py::array::c_style>::ensure(arr);
        for (py::ssize_t i = 0; i < u.size(); ++i)
          if (u.data()[i] >= kNone) throw py::value_error("invalid token id " + std::to_string(u.data()[i]));
      }
      out.reserve(size_t(a.size()) * 4);
      for (py::ssize_t i = 0; i < a.size(); ++i) add(a.data()[i]);
    } else {
      if (PyUnicode_Check(ids.ptr()) || PyBytes_Check(ids.ptr()))
        throw py::type_error("token ids must be a sequence of int, not " + std::string(Py_TYPE(ids.ptr())->tp_name));
      for (py::handle item : ids) {
        if (!PyLong_Check(item.ptr()))
          throw py::type_error("token ids must be int, got " + std::string(Py_TYPE(item.ptr())->tp_name));
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(item.ptr(), &overflow);
        if (overflow) throw py::value_error("invalid token id " + std::string(py::str(item)) + " (not in the vocabulary)");
        add(v);
      }
    }
    return py::bytes(out);
  }

  py::object token_bytes(long long id) {
    if (id >= 0 && id < (long long)kNone && core_->vocab().has(uint32_t(id)))
      return py::bytes(reinterpret_cast<const char*>(core_->vocab().bytes(uint32_t(id))), core_->vocab().len(uint32_t(id)));
    long k = id >= 0 && id < (long long)kNone ? core_->special_index(uint32_t(id)) : -1;
    if (k >= 0) return py::bytes(core_->specials()[size_t(k)].text);
    throw py::value_error("invalid token id " + std::to_string(id) + " (not in the vocabulary)");
  }

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

uint16_t classify(uint32_t cp) {
  if (cp >= 0x110000) throw py::value_error("not a code point");
  return CharClasses::get().of(cp);
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "Native core of k3serve.tokenizer (see k3serve/tokenizer/native/)";
  py::class_<PyCore>(m, "Core")
      .def_static("from_tiktoken", &PyCore::from_tiktoken)
      .def_static("from_ranks", &PyCore::from_ranks)
      .def("encode", &PyCore::encode)
      .def("count", &PyCore::count)
      .def("encode_segments", &PyCore::encode_segments)
      .def("encode_batch", &PyCore::encode_batch)
      .def("decode_bytes", &PyCore::decode_bytes)
      .def("token_bytes", &PyCore::token_bytes)
      .def("pieces", &PyCore::pieces)
      .def("cut_parts", &PyCore::cut_parts)
      .def("bpe", &PyCore::bpe)
      .def("linear_ok", &PyCore::linear_ok)
      .def("cache_stats", &PyCore::cache_stats)
      .def("cache_clear", &PyCore::cache_clear)
      .def("prebuild", &PyCore::prebuild)
      .def_property_readonly("n_ranks", &PyCore::n_ranks);
  m.def("classify", &classify);
  m.attr("HAN") = int(kHan);
  m.attr("LETTER") = int(kLetter);
  m.attr("NUMBER") = int(kNumber);
  m.attr("UPPER") = int(kUpper);
  m.attr("LOWER") = int(kLower);
  m.attr("WS") = int(kWs);
  m.attr("PYSPACE") = int(kPySpace);
}
