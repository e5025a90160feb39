// NumPy arrays in and out of the bindings: conversions and the checks whose messages users see
// (a bad array names its table and what was expected). Shared by bindings.cc and
// testing_bindings.cc.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "hybridsync/ps.h"

namespace hybridsync {
namespace py = pybind11;

using IdArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using RowArray = py::array_t<float, py::array::c_style>;

// Moves a vector into a NumPy array without copying; the array owns it.
template <class T>
py::array_t<T> to_numpy(std::vector<T>&& v, std::vector<py::ssize_t> shape) {
  auto* owned = new std::vector<T>(std::move(v));
  py::capsule free_when_done(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>(shape, owned->data(), free_when_done);
}

inline std::string shape_text(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

// Ids as a flat int64 array; an empty error string means it is usable. `shape`: the ids' own.
inline IdArray ids_of(const py::object& obj, const std::string& table, std::string* error,
               std::vector<py::ssize_t>* shape = nullptr) {
  py::array a = py::array::ensure(obj);
  if (!a) {
    *error = "table '" + table + "': ids must be an array of integers";
    return IdArray();
  }
  const char kind = a.dtype().kind();
  if (kind != 'i' && kind != 'u') {
    *error = "table '" + table + "': ids must be integers, got dtype " + std::string(py::str(a.dtype()));
    return IdArray();
  }
  if (shape) shape->assign(a.shape(), a.shape() + a.ndim());
  if (a.ndim() == 1) return IdArray::ensure(a);  // no Python-level reshape: this runs per table per step
  return IdArray::ensure(a.attr("reshape")(-1));
}

// Gradient rows: float32, shape (n, dim).
inline RowArray grads_of(const py::object& obj, const std::string& table, int64_t n, int64_t dim,
                  std::string* error, const char* what = "gradients") {
  py::array a = py::array::ensure(obj);
  if (!a || a.dtype().kind() != 'f' || a.itemsize() != 4) {
    *error = "table '" + table + "': " + what + " must be float32, got " +
             (a ? "dtype " + std::string(py::str(a.dtype())) : std::string("a non-array"));
    return RowArray();
  }
  if (a.ndim() != 2 || a.shape(0) != n || a.shape(1) != dim) {
    *error = "table '" + table + "': " + what + " shape " + shape_text(a) + " does not match (" +
             std::to_string(n) + ", " + std::to_string(dim) + ") for " + std::to_string(n) +
             " ids of a table with dim " + std::to_string(dim);
    return RowArray();
  }
  return RowArray::ensure(a);
}

// Full-table float32 buffer (num_rows, dim) the engine writes into in place.
inline float* table_buffer(const py::object& obj, const TableSpec& spec, bool writable, std::string* error) {
  py::array a = py::array::ensure(obj);
  const bool ok = a && a.dtype().kind() == 'f' && a.itemsize() == 4 && a.ndim() == 2 &&
                  a.shape(0) == spec.num_rows && a.shape(1) == spec.dim &&
                  (a.flags() & py::array::c_style) && (!writable || a.writeable());
  if (!ok) {
    *error = "table '" + spec.name + "': expected a " + (writable ? "writable " : "") +
             "C-contiguous float32 array of shape (" + std::to_string(spec.num_rows) + ", " +
             std::to_string(spec.dim) + "), got " +
             (a ? std::string(py::str(a.dtype())) + " " + shape_text(a) : std::string("a non-array"));
    return nullptr;
  }
  return static_cast<float*>(a.mutable_data());
}

}  // namespace hybridsync
