// pybind11 bindings: k3serve.tokenizer._native (the object itself is in py_core.h). The GIL is
// released while encoding; outputs are numpy uint32 arrays that own their buffer.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>

#include "classes.h"
#include "py_core.h"

namespace py = pybind11;
using namespace k3tok;

namespace {

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
