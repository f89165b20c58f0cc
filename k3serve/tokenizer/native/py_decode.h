// Token ids back to bytes: ids may come as a numpy array of any integer dtype or as a sequence of
// Python ints; special-token ids decode to their text, anything else is an error.
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "core.h"

namespace k3tok {

namespace py = pybind11;

inline py::bytes decode_bytes(const Core& core, py::handle ids) {
  std::string out;
  auto add = [&](long long id) {
    if (id >= 0 && id < (long long)kNone) {
      uint32_t u = uint32_t(id);
      if (core.vocab().has(u)) {
        out.append(reinterpret_cast<const char*>(core.vocab().bytes(u)), core.vocab().len(u));
        return;
      }
      long k = core.special_index(u);
      if (k >= 0) {
        out += core.specials()[size_t(k)].text;
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
      // integer-like objects (numpy integer scalars from iterating an encode() result) go through
      // __index__, as in tiktoken; floats and other types stay an error
      py::object as_int;
      if (!PyLong_Check(item.ptr())) {
        if (!PyIndex_Check(item.ptr()) || PyFloat_Check(item.ptr()))
          throw py::type_error("token ids must be int, got " + std::string(Py_TYPE(item.ptr())->tp_name));
        as_int = py::reinterpret_steal<py::object>(PyNumber_Index(item.ptr()));
        if (!as_int) throw py::error_already_set();
        item = as_int;
      }
      int overflow = 0;
      long long v = PyLong_AsLongLongAndOverflow(item.ptr(), &overflow);
      if (overflow) throw py::value_error("invalid token id " + std::string(py::str(item)) + " (not in the vocabulary)");
      add(v);
    }
  }
  return py::bytes(out);
}

inline py::object token_bytes(const Core& core, long long id) {
  if (id >= 0 && id < (long long)kNone && core.vocab().has(uint32_t(id)))
    return py::bytes(reinterpret_cast<const char*>(core.vocab().bytes(uint32_t(id))), core.vocab().len(uint32_t(id)));
  long k = id >= 0 && id < (long long)kNone ? core.special_index(uint32_t(id)) : -1;
  if (k >= 0) return py::bytes(core.specials()[size_t(k)].text);
  throw py::value_error("invalid token id " + std::to_string(id) + " (not in the vocabulary)");
}

}  // namespace k3tok
