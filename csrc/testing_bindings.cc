// The Python module hybridsync._ps_testing: internals the unit tests check on their own -- a single
// Shard with its update rule, the Partitioner and a dynamic table's hash and initial rows (which
// hybridsync/ps/partition.py and dynamic_options.py mirror), the watchdog's last words. Not the PS
// API, and not in the engine's module.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>

#include "bindings_arrays.h"
#include "ps/dedup.h"
#include "ps/dynamic_store.h"
#include "ps/partitioner.h"
#include "ps/shard.h"
#include "transport/heartbeat.h"

namespace py = pybind11;
using namespace hybridsync;

namespace {

PartitionKind partition_kind(const std::string& name) {
  if (name == "cyclic") return PartitionKind::kCyclic;
  if (name == "block") return PartitionKind::kBlock;
  throw PSError("unknown partition '" + name + "' (known: cyclic, block)");
}

// A single shard on its own, for tests and single-process use: ids are its local rows.
class PyShard {
 public:
  PyShard(const std::string& name, int64_t rows, int64_t dim, const std::string& optimizer,
          const std::map<std::string, double>& hparams)
      : shard_(name, rows, dim, make_update_rule(optimizer, hparams)) {}

  RowArray pull(const py::object& ids_obj) {
    std::string error;
    IdArray ids = ids_of(ids_obj, shard_.table(), &error);
    if (!error.empty()) throw PSError(error);
    Dedup dd = deduplicate(shard_.table(), ids.data(), ids.size(), shard_.rows());
    RowArray out({static_cast<py::ssize_t>(ids.size()), static_cast<py::ssize_t>(shard_.dim())});
    std::vector<float> rows(dd.unique.size() * shard_.dim());
    shard_.gather(dd.unique.data(), static_cast<int64_t>(dd.unique.size()), rows.data());
    float* dst = out.mutable_data();
    for (py::ssize_t i = 0; i < ids.size(); ++i) {
      std::memcpy(dst + i * shard_.dim(), rows.data() + dd.inverse[i] * shard_.dim(), sizeof(float) * shard_.dim());
    }
    return out;
  }

  void push(const py::object& ids_obj, const py::object& grads_obj) {
    std::string error;
    IdArray ids = ids_of(ids_obj, shard_.table(), &error);
    RowArray grads;
    if (error.empty()) grads = grads_of(grads_obj, shard_.table(), ids.size(), shard_.dim(), &error);
    if (!error.empty()) throw PSError(error);
    // The servers' own step: duplicate rows added up, one optimizer step over the sums.
    check_ids(shard_.table(), ids.data(), ids.size(), shard_.rows());
    sums_.step(shard_, {GradientRows{ids.data(), ids.size(), grads.data()}}, 1.0f);
  }

  py::array_t<float> values(int slot) const {
    if (slot >= shard_.num_slots()) throw PSError("no optimizer state slot " + std::to_string(slot));
    std::vector<float> copy(static_cast<size_t>(shard_.rows() * shard_.dim()));
    for (int64_t l = 0; l < shard_.rows(); ++l) {
      const float* src = slot < 0 ? shard_.row(l) : shard_.slot(slot) + l * shard_.dim();
      std::memcpy(copy.data() + l * shard_.dim(), src, sizeof(float) * shard_.dim());
    }
    return to_numpy(std::move(copy), {static_cast<py::ssize_t>(shard_.rows()), static_cast<py::ssize_t>(shard_.dim())});
  }

  void set_values(int slot, const py::object& values) {
    std::string error;
    TableSpec spec;
    spec.name = shard_.table();
    spec.num_rows = shard_.rows();
    spec.dim = shard_.dim();
    const float* data = table_buffer(values, spec, false, &error);
    if (!error.empty()) throw PSError(error);
    if (slot >= shard_.num_slots()) throw PSError("no optimizer state slot " + std::to_string(slot));
    for (int64_t l = 0; l < shard_.rows(); ++l) {
      float* dst = slot < 0 ? shard_.row(l) : shard_.slot(slot) + l * shard_.dim();
      std::memcpy(dst, data + l * shard_.dim(), sizeof(float) * shard_.dim());
    }
  }

  Shard& shard() { return shard_; }

 private:
  Shard shard_;
  RowAggregator sums_;
};

}  // namespace

PYBIND11_MODULE(_ps_testing, m) {
  // The engine's module translates the core's errors (PSError -> ValueError, ...): load it first.
  py::module_::import("hybridsync._ps");
  m.def("say_lost_host_last_words", [] { say_lost_host_last_words(); });
  // The C++ sides of hybridsync/dynamic.py's twins.
  m.def("hash_shard", [](const std::vector<int64_t>& ids, int shards) {
    std::vector<int64_t> out;
    for (int64_t id : ids) out.push_back(hash_shard(id, shards));
    return out;
  });
  m.def("dynamic_initial_rows", [](uint64_t seed, const std::vector<int64_t>& ids, int64_t dim, const std::string& init,
                                   double a, double b) {
    DynamicSpec spec;
    spec.on = true;
    spec.seed = seed;
    spec.init = init;
    spec.init_a = a;
    spec.init_b = b;
    DynamicStore store("twin", spec, 0, dim);
    std::vector<float> out(ids.size() * static_cast<size_t>(dim));
    store.initial_rows(ids.data(), static_cast<int64_t>(ids.size()), out.data());  // the batch a pull computes
    return out;
  });
  py::class_<Partitioner>(m, "Partitioner")
      .def(py::init([](int64_t rows, int shards, const std::string& kind) {
             return Partitioner(rows, shards, partition_kind(kind));
           }),
           py::arg("num_rows"), py::arg("num_shards"), py::arg("kind") = "cyclic")
      .def("shard_of", &Partitioner::shard_of)
      .def("local_index", &Partitioner::local_index)
      .def("global_id", &Partitioner::global_id)
      .def("shard_rows", &Partitioner::shard_rows);

  py::class_<PyShard>(m, "Shard")
      .def(py::init<const std::string&, int64_t, int64_t, const std::string&, const std::map<std::string, double>&>(),
           py::arg("name"), py::arg("rows"), py::arg("dim"), py::arg("optimizer") = "sgd",
           py::arg("hparams") = std::map<std::string, double>{})
      .def("pull", &PyShard::pull, py::arg("ids"), "Rows of `ids` (duplicates allowed), shape (len(ids), dim).")
      .def("push", &PyShard::push, py::arg("ids"), py::arg("grads"),
           "Sums the gradients of duplicate ids, then applies the optimizer once per row.")
      .def("values", &PyShard::values, py::arg("slot") = -1)
      .def("set_values", &PyShard::set_values, py::arg("slot"), py::arg("values"))
      .def_property_readonly("step", [](PyShard& s) { return s.shard().rule().step(); })
      .def_property_readonly("rows", [](PyShard& s) { return s.shard().rows(); })
      .def_property_readonly("dim", [](PyShard& s) { return s.shard().dim(); })
      .def_property_readonly("slot_names", [](PyShard& s) { return s.shard().rule().slot_names(); });

}
