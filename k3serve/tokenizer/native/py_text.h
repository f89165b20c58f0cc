// Python text in, token ids out: the UTF-8 bytes of a str without a copy where possible, and numpy
// uint32 arrays that own their buffer (no Python list is built).
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace k3tok {

namespace py = pybind11;

// UTF-8 of a str. ASCII strings are used in place; others are converted here (faster than
// CPython's encoder on mostly-ASCII text, and nothing is cached on the str object). A lone
// surrogate makes CPython raise its UnicodeEncodeError, which the Python layer handles.
// A byte buffer that grows without zero-filling: the worst-case UTF-8 size is 2-4x the text and
// only the bytes written are ever touched (a std::string resize would memset all of it).
struct Utf8Buf {
  std::unique_ptr<uint8_t[]> data;
  size_t cap = 0, size = 0;
  uint8_t* reserve(size_t n) {
    if (n > cap) {
      data.reset(new uint8_t[n]);
      cap = n;
    }
    return data.get();
  }
  std::string_view view() const { return std::string_view(reinterpret_cast<const char*>(data.get()), size); }
  void release_if_over(size_t limit) {  // keep no huge buffer in a thread-local
    if (cap > limit) {
      data.reset();
      cap = size = 0;
    }
  }
};

struct Utf8Text {
  std::string_view view;
  Utf8Buf owned;
};

template <class CharT>
inline bool encode_utf8(const CharT* s, size_t n, Utf8Buf& out) {
  uint8_t* o = out.reserve(n * (sizeof(CharT) == 1 ? 2 : sizeof(CharT) == 2 ? 3 : 4) + 1);
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
  out.size = size_t(o - begin);
  return true;
}

inline void utf8_of(py::handle h, const char* what, Utf8Text& t) {
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
  t.view = t.owned.view();
}

inline const uint8_t* u8(std::string_view v) { return reinterpret_cast<const uint8_t*>(v.data()); }

inline py::array_t<uint32_t> to_array(std::vector<uint32_t>&& v) {
  if (v.capacity() > 2 * v.size() + 64) v.shrink_to_fit();
  auto* owned = new std::vector<uint32_t>(std::move(v));
  py::capsule free_it(owned, [](void* p) { delete static_cast<std::vector<uint32_t>*>(p); });
  return py::array_t<uint32_t>({owned->size()}, {sizeof(uint32_t)}, owned->data(), free_it);
}

}  // namespace k3tok
