// pybind11 module hybridsync._ps: the C++ parameter server, seen from Python through NumPy
// arrays (torch and TF adapters pass zero-copy views). Every call into the Client releases the
// GIL first: the Client serialises its callers with a lock, and a thread holding the GIL while
// it waits for that lock would stall the thread inside a collective that needs the GIL back.
// Bad arrays never make a rank skip a collective: they become an `error` the Client announces
// to every peer, so all ranks raise instead of leaving one waiting.
#include <mpi.h>
#include <mpi4py/mpi4py.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <set>

#include "bindings_arrays.h"
#include "hybridsync/liveness.h"
#include "hybridsync/ps.h"
#include "stats/squared_norm.h"

namespace py = pybind11;
using namespace hybridsync;

namespace {

PartitionKind partition_kind(const std::string& name) {
  if (name == "cyclic") return PartitionKind::kCyclic;
  if (name == "block") return PartitionKind::kBlock;
  throw PSError("unknown partition '" + name + "' (known: cyclic, block)");
}

// A dynamic table's options from a dict (capacity, admit_after, evict, ttl_steps, seed, init,
// init_a, init_b; capacity / ttl_steps None: unbounded / no expiry); bad ones set `error`.
DynamicSpec dynamic_spec(const py::object& options, std::string* error) {
  DynamicSpec d;
  if (options.is_none()) return d;
  d.on = true;
  try {
    const py::dict o = options.cast<py::dict>();
    auto number = [&](const char* key, int64_t fallback) {
      return o.contains(key) && !o[key].is_none() ? o[key].cast<int64_t>() : fallback;
    };
    for (auto item : o) {
      const std::string key = item.first.cast<std::string>();
      static const std::set<std::string> known = {"capacity", "admit_after", "evict", "ttl_steps",
                                                  "seed",     "init",        "init_a", "init_b"};
      if (!known.count(key)) throw PSError("unknown dynamic table option '" + key + "'");
    }
    d.capacity = number("capacity", 0);
    if (o.contains("capacity") && !o["capacity"].is_none() && d.capacity == 0) d.capacity = -1;  // 0 is no capacity
    d.admit_after = number("admit_after", 1);
    d.ttl_steps = number("ttl_steps", 0);
    if (o.contains("ttl_steps") && !o["ttl_steps"].is_none() && d.ttl_steps == 0) d.ttl_steps = -1;
    d.evict = o.contains("evict") && !o["evict"].is_none() ? o["evict"].cast<std::string>() : "none";
    d.seed = static_cast<uint64_t>(number("seed", 0));
    if (o.contains("init")) d.init = o["init"].cast<std::string>();
    if (o.contains("init_a")) d.init_a = o["init_a"].cast<double>();
    if (o.contains("init_b")) d.init_b = o["init_b"].cast<double>();
  } catch (const py::cast_error&) {
    *error = "dynamic table options must be numbers (capacity, admit_after, ttl_steps, seed, init_a, init_b) "
             "and strings (evict, init)";
  } catch (const PSError& e) {
    *error = e.what();
  }
  return d;
}

// A table's storage options from a dict (dtype, rounding, seed, memory_rows, disk_rows, path;
// None values: unset), as hybridsync/storage.py checked them; bad ones set `error`.
StorageSpec storage_spec(const py::object& options, std::string* error) {
  StorageSpec st;
  if (options.is_none()) return st;
  try {
    const py::dict o = options.cast<py::dict>();
    static const std::set<std::string> known = {"dtype", "rounding", "seed", "memory_rows", "disk_rows", "path"};
    for (auto item : o) {
      const std::string key = item.first.cast<std::string>();
      if (!known.count(key)) throw PSError("unknown storage option '" + key + "'");
    }
    auto given = [&](const char* key) { return o.contains(key) && !o[key].is_none(); };
    if (given("dtype")) st.dtype = o["dtype"].cast<std::string>();
    if (given("rounding")) st.rounding = o["rounding"].cast<std::string>();
    if (given("seed")) st.seed = static_cast<uint64_t>(o["seed"].cast<int64_t>());
    if (given("memory_rows")) st.memory_rows = o["memory_rows"].cast<int64_t>();
    if (given("disk_rows")) st.disk_rows = o["disk_rows"].cast<int64_t>();
    if (given("path")) st.path = o["path"].cast<std::string>();
  } catch (const py::cast_error&) {
    *error = "storage options must be strings (dtype, rounding, path) and integers (memory_rows, disk_rows, seed)";
  } catch (const PSError& e) {
    *error = e.what();
  }
  return st;
}

// Runs `body` on the Client without the GIL (see the top of this file).
template <class F>
auto nogil(F&& body) -> decltype(body()) {
  py::gil_scoped_release release;
  return body();
}

// An operation with bad input still runs, so peers stay in step: with the same tables and no
// rows, so it takes the same path as theirs (a round, or a bounded table's one-sided requests).
std::vector<TableBatch> rowless(const std::vector<int>& tables) {
  std::vector<TableBatch> batches;
  for (const int t : tables) batches.push_back({t});
  return batches;
}

// The Python object around a Client.
class PyEngine {
 public:
  PyEngine(py::object comm, const WaitPolicy& policy, int64_t max_message_bytes) {
    MPI_Comm* c = PyMPIComm_Get(comm.ptr());
    if (!c) throw py::error_already_set();
    client_ = make_client("mpi", c, policy, max_message_bytes);
  }

  // Collective. A bad partition name becomes the operation's error, so every rank raises.
  int add_table(const std::string& name, int64_t num_rows, int64_t dim, int num_shards,
                const std::string& partition, const std::string& optimizer,
                const std::map<std::string, double>& hparams, const py::object& dynamic, const py::object& storage) {
    std::string error;
    PartitionKind kind = PartitionKind::kCyclic;
    try {
      kind = partition_kind(partition);
    } catch (const PSError& e) {
      error = e.what();
    }
    TableSpec spec{name, num_rows, dim, num_shards, kind, optimizer, hparams, dynamic_spec(dynamic, &error),
                   storage_spec(storage, &error)};
    return nogil([&] { return client_->add_table(spec, error); });
  }

  // Collective. Per table (unique ids, inverse, unique rows); with in_order[b], (unique ids,
  // None, rows) instead, rows[i] the row of ids[i] shaped ids.shape + (dim,): a NumPy array the
  // engine writes each row into once (in a world of one straight from the shard, and unique is
  // empty: nothing was pulled from anywhere). What embedding forwards need, all in one round.
  // `given_error`: this rank's bad input found by the caller, raised on every rank.
  py::list pull(const std::vector<int>& tables, const py::list& ids, const std::vector<bool>& in_order,
                const std::string& given_error = "") {
    std::string error = given_error;
    std::vector<IdArray> keep;
    std::vector<TableBatch> batches;
    std::vector<int64_t> dims;
    std::vector<py::object> outs(tables.size(), py::none());
    if (tables.size() != ids.size()) error = "pull: " + std::to_string(tables.size()) + " tables but " + std::to_string(ids.size()) + " id arrays";
    if (!in_order.empty() && in_order.size() != tables.size()) error = "pull: in_order needs one flag per table";
    for (size_t b = 0; b < tables.size() && error.empty(); ++b) {
      const TableSpec spec = spec_or_error(tables[b], &error);
      if (!error.empty()) break;
      std::vector<py::ssize_t> shape;
      keep.push_back(ids_of(ids[b], spec.name, &error, &shape));
      dims.push_back(spec.dim);
      if (!error.empty()) break;
      batches.push_back({tables[b], keep.back().data(), keep.back().size(), nullptr});
      if (!in_order.empty() && in_order[b]) {
        shape.push_back(static_cast<py::ssize_t>(spec.dim));
        py::array_t<float> out(shape);
        batches.back().out = out.mutable_data();
        outs[b] = std::move(out);
      }
    }
    if (!error.empty()) batches = rowless(tables);  // the operation still runs, so peers stay in step
    std::vector<PullResult> results = nogil([&] { return client_->pull(batches, error); });
    py::list out;
    for (size_t b = 0; b < results.size(); ++b) {
      const auto u = static_cast<py::ssize_t>(results[b].unique.size());
      const auto n = static_cast<py::ssize_t>(results[b].inverse.size());
      py::object unique = to_numpy(std::move(results[b].unique), {u});
      if (!outs[b].is_none()) {
        out.append(py::make_tuple(unique, py::none(), outs[b]));
        continue;
      }
      out.append(py::make_tuple(unique, to_numpy(std::move(results[b].inverse), {n}),
                                to_numpy(std::move(results[b].rows), {u, static_cast<py::ssize_t>(dims[b])})));
    }
    return out;
  }

  // Pull for one table in input order: (unique ids, rows) as pull(..., in_order) gives them.
  py::tuple lookup(int table, const py::object& ids, const std::string& error) {
    py::list one;
    one.append(ids);
    auto result = pull({table}, one, {true}, error)[0].cast<py::tuple>();
    return py::make_tuple(result[0], result[2]);
  }

  // Collective. Returns, with return_updates, one (ids, rows) pair per table: every row any
  // shard changed.
  py::object push(const std::vector<int>& tables, const py::list& ids, const py::list& grads, float scale,
                  bool return_updates, const py::object& lrs) {
    std::string error;
    std::vector<IdArray> keep_ids;
    std::vector<RowArray> keep_grads;
    std::vector<TableBatch> batches;
    std::vector<double> lr_values;
    std::vector<int64_t> dims;
    if (tables.size() != ids.size() || tables.size() != grads.size()) {
      error = "push: tables, ids and grads must have the same length";
    } else if (!lrs.is_none()) {
      try {  // a bad value must not make this rank skip the collective
        lr_values = lrs.cast<std::vector<double>>();
      } catch (const py::cast_error&) {
        error = "push: learning rates must be a sequence of numbers";
      }
      if (error.empty() && lr_values.size() != tables.size()) error = "push: one learning rate per table is required";
    }
    for (size_t b = 0; b < tables.size() && error.empty(); ++b) {
      const TableSpec spec = spec_or_error(tables[b], &error);
      if (!error.empty()) break;
      dims.push_back(spec.dim);
      keep_ids.push_back(ids_of(ids[b], spec.name, &error));
      if (!error.empty()) break;
      keep_grads.push_back(grads_of(grads[b], spec.name, keep_ids.back().size(), spec.dim, &error));
      if (!error.empty()) break;
      const double lr = lr_values.empty() ? -1.0 : lr_values[b];
      if (!lr_values.empty() && !(lr >= 0)) {
        error = "table '" + spec.name + "': learning rate must be >= 0, got " + std::to_string(lr);
        break;
      }
      batches.push_back({tables[b], keep_ids.back().data(), keep_ids.back().size(), keep_grads.back().data(), lr});
    }
    if (!error.empty()) batches = rowless(tables);  // the operation still runs, so peers stay in step
    std::vector<RowUpdates> updates = nogil([&] { return client_->push(batches, scale, return_updates, error); });
    if (!return_updates) return py::none();
    py::list out;
    for (size_t b = 0; b < updates.size(); ++b) {
      const auto n = static_cast<py::ssize_t>(updates[b].ids.size());
      out.append(py::make_tuple(to_numpy(std::move(updates[b].ids), {n}),
                                to_numpy(std::move(updates[b].rows), {n, static_cast<py::ssize_t>(dims[b])})));
    }
    return out;
  }

  // Collective. Only the root reads `values`; a bad array there becomes the operation's error,
  // so every rank raises instead of the shards waiting for rows until the timeout.
  // consume: the root gives `values` up (its memory is returned as the rows reach the shards).
  void load_from_root(int table, const py::object& values, int root, bool consume) {
    std::string error;
    const float* data = nullptr;
    if (client_->rank() == root) data = table_buffer(values, spec(table), consume, &error);
    nogil([&] { client_->load_from_root(table, data, root, error, consume); });
  }

  void load_local(int table, int slot, const py::object& values) {
    std::string error;
    const float* data = table_buffer(values, spec(table), false, &error);
    if (!error.empty()) throw PSError(error);
    nogil([&] { client_->load_local(table, slot, data); });
  }

  // The shard's rows alias `replica` (kept alive by the caller, who re-attaches if its memory
  // moves); None detaches.
  void attach_replica(int table, const py::object& replica) {
    float* data = nullptr;
    if (!replica.is_none()) {
      std::string error;
      data = table_buffer(replica, spec(table), true, &error);
      if (!error.empty()) throw PSError(error);
    }
    nogil([&] { client_->attach_replica(table, data); });
  }

  // Local: rows (slot < 0) or optimizer slot values of the ids this rank holds.
  void write_local(int table, const py::object& ids_obj, const py::object& rows_obj, int slot) {
    auto [ids, rows] = ids_and_rows(table, ids_obj, rows_obj);
    nogil([&] { client_->write_local(table, slot, ids.data(), ids.size(), rows.data()); });
  }

  // One-sided: rows (slot < 0) or optimizer slot values of any ids, on whichever shards hold them.
  void write_rows(int table, const py::object& ids_obj, const py::object& rows_obj, int slot) {
    auto [ids, rows] = ids_and_rows(table, ids_obj, rows_obj);
    nogil([&] { client_->write_rows(table, slot, ids.data(), ids.size(), rows.data()); });
  }

  // One-sided: the whole table (num_rows, dim) written to its shards in chunks.
  void write_table(int table, const py::object& values, int slot) {
    std::string error;
    const float* data = table_buffer(values, spec(table), false, &error);
    if (!error.empty()) throw PSError(error);
    nogil([&] { client_->write_table(table, slot, data); });
  }

  // One-sided: rows (slot < 0) or slot values of `ids`, shaped ids.shape + (dim,).
  py::array_t<float> read_rows(int table, const py::object& ids_obj, int slot) {
    std::string error;
    const TableSpec spec = this->spec(table);
    std::vector<py::ssize_t> shape;
    IdArray ids = ids_of(ids_obj, spec.name, &error, &shape);
    if (!error.empty()) throw PSError(error);
    shape.push_back(static_cast<py::ssize_t>(spec.dim));
    py::array_t<float> out(shape);
    float* dst = out.mutable_data();
    nogil([&] { client_->read_rows(table, slot, ids.data(), ids.size(), dst); });
    return out;
  }

  // One-sided: the whole table (slot < 0) or optimizer slot, streamed from the shards.
  py::array_t<float> read_table(int table, int slot, bool hand_over) {
    const TableSpec spec = this->spec(table);
    py::array_t<float> out({static_cast<py::ssize_t>(spec.num_rows), static_cast<py::ssize_t>(spec.dim)});
    float* dst = out.mutable_data();
    nogil([&] { client_->read_table(table, slot, dst, hand_over); });
    return out;
  }

  // Local: rows (slot < 0) or slot values of this rank's rows `ids`, shaped (n, dim).
  py::array_t<float> local_rows(int table, const py::object& ids_obj, int slot) {
    std::string error;
    const TableSpec spec = this->spec(table);
    IdArray ids = ids_of(ids_obj, spec.name, &error);
    if (!error.empty()) throw PSError(error);
    py::array_t<float> out({static_cast<py::ssize_t>(ids.size()), static_cast<py::ssize_t>(spec.dim)});
    float* dst = out.mutable_data();
    nogil([&] { client_->local_rows(table, slot, ids.data(), ids.size(), dst); });
    return out;
  }

  // This rank's rows (slot < 0) or optimizer slot, (shard_rows, dim) in storage order.
  py::array_t<float> local_values(int table, int slot) {
    const TableSpec spec = this->spec(table);
    std::vector<float> values = nogil([&] { return client_->local_values(table, slot); });
    const auto rows = static_cast<py::ssize_t>(values.size() / static_cast<size_t>(spec.dim));
    return to_numpy(std::move(values), {rows, static_cast<py::ssize_t>(spec.dim)});
  }

  // Local: this rank's shard of a dynamic table as arrays (ids, rows, slot.<k>, counts, ...).
  py::dict dynamic_state(int table) {
    return state_dict(nogil([&] { return client_->dynamic_state(table); }));
  }

  // Local: entries [begin, begin + n) of this rank's shard as dynamic_state's arrays (stored
  // ids with their counts, and their rows and slots if `rows`; or pending ids), in storage order.
  py::dict dynamic_range(int table, bool pending, int64_t begin, int64_t n, bool rows) {
    return state_dict(nogil([&] { return client_->dynamic_range(table, pending, begin, n, rows); }));
  }

  // One-sided: every shard's (step, stored rows, pending ids).
  std::vector<std::array<int64_t, 3>> dynamic_sizes(int table) {
    return nogil([&] { return client_->dynamic_sizes(table); });
  }

  // One-sided: shard `shard` of a dynamic table as dynamic_state's arrays (rows and slots as
  // asked; empty otherwise), and "step".
  py::dict read_dynamic(int table, int shard, bool rows, bool slots) {
    int64_t step = -1;
    py::dict d = state_dict(nogil([&] { return client_->read_dynamic(table, shard, rows, slots, &step); }));
    d["step"] = step;
    return d;
  }

  // One-sided: dynamic_state's arrays (of any shards; "slots" may be empty) written to the
  // shards owning their ids, as `how` says: "upsert", "replace" (every shard emptied and set to
  // `step` first) or "slots" (the slots of the stored ones among "ids"; only those two keys).
  void write_dynamic(int table, const py::dict& d, const std::string& how, int64_t step) {
    static const std::map<std::string, DynamicWrite> hows{
        {"upsert", DynamicWrite::kUpsert}, {"replace", DynamicWrite::kReplace}, {"slots", DynamicWrite::kSlots}};
    const auto it = hows.find(how);
    if (it == hows.end()) throw PSError("write_dynamic: how must be 'upsert', 'replace' or 'slots', got '" + how + "'");
    DynamicState s = to_state(table, d);
    nogil([&] { client_->write_dynamic(table, s, it->second, step); });
  }

  static py::dict state_dict(DynamicState s) {
    const auto n = static_cast<py::ssize_t>(s.ids.size()), dim = static_cast<py::ssize_t>(s.dim);
    py::dict d;
    d["ids"] = to_numpy(std::move(s.ids), {n});
    const py::ssize_t with_rows = s.rows.size() == static_cast<size_t>(n * dim) ? n : 0;  // (rows not read: none)
    d["rows"] = to_numpy(std::move(s.rows), {with_rows, dim});
    d["counts"] = to_numpy(std::move(s.counts), {n});
    d["last_touch"] = to_numpy(std::move(s.last_touch), {n});
    py::list slots;
    for (auto& v : s.slots) slots.append(to_numpy(std::move(v), {n, dim}));
    d["slots"] = slots;
    const auto p = static_cast<py::ssize_t>(s.pending_ids.size());
    d["pending_ids"] = to_numpy(std::move(s.pending_ids), {p});
    d["pending_counts"] = to_numpy(std::move(s.pending_counts), {p});
    d["pending_last"] = to_numpy(std::move(s.pending_last), {p});
    return d;
  }

  // Local: what dynamic_state returned (any shard's: ids this rank's shard does not own are skipped).
  void dynamic_restore(int table, const py::dict& d) {
    DynamicState s = to_state(table, d);
    nogil([&] { client_->dynamic_restore(table, s); });
  }

  DynamicState to_state(int table, const py::dict& d) {
    DynamicState s;
    s.dim = spec(table).dim;
    // (a key that is absent is an empty array: write_dynamic's "slots" takes only ids and slots)
    auto ints = [&](const char* key) {
      if (!d.contains(key)) return std::vector<int64_t>{};
      return py::cast<std::vector<int64_t>>(py::array_t<int64_t>::ensure(d[key]).attr("ravel")());
    };
    auto floats = [&](const py::object& a) { return py::cast<std::vector<float>>(py::array_t<float>::ensure(a).attr("ravel")()); };
    s.ids = ints("ids");
    s.counts = ints("counts");
    s.last_touch = ints("last_touch");
    if (d.contains("rows")) s.rows = floats(d["rows"]);
    if (d.contains("slots")) {
      for (auto slot : d["slots"].cast<py::list>()) s.slots.push_back(floats(py::reinterpret_borrow<py::object>(slot)));
    }
    s.pending_ids = ints("pending_ids");
    s.pending_counts = ints("pending_counts");
    s.pending_last = ints("pending_last");
    return s;
  }

  TableSpec spec(int table) {
    return nogil([&] { return client_->spec(table); });
  }

  Client& client() { return *client_; }

 private:
  // The spec of `table`, or (an empty one and) an error naming the bad handle.
  TableSpec spec_or_error(int table, std::string* error) {
    try {
      return spec(table);
    } catch (const PSError& e) {
      *error = e.what();
      return TableSpec{};
    }
  }

  // Ids and their rows (n, dim) checked for a write; bad ones raise here (no collective runs).
  std::pair<IdArray, RowArray> ids_and_rows(int table, const py::object& ids_obj, const py::object& rows_obj) {
    std::string error;
    const TableSpec spec = this->spec(table);
    IdArray ids = ids_of(ids_obj, spec.name, &error);
    RowArray rows;
    if (error.empty()) rows = grads_of(rows_obj, spec.name, ids.size(), spec.dim, &error, "rows");
    if (!error.empty()) throw PSError(error);
    return {std::move(ids), std::move(rows)};
  }

  std::unique_ptr<Client> client_;
};

}  // namespace

PYBIND11_MODULE(_ps, m) {
  m.doc() = "hybridsync parameter server core (C++)";
  if (import_mpi4py() < 0) throw py::error_already_set();

  static py::exception<PSRemoteError> remote_error(m, "RemoteError", PyExc_RuntimeError);
  static py::exception<PSTransportError> transport_error(m, "TransportError", remote_error.ptr());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const PSIndexError& e) {
      PyErr_SetString(PyExc_IndexError, e.what());
    } catch (const PSError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const PSTransportError& e) {
      PyErr_SetString(transport_error.ptr(), e.what());
    } catch (const PSRemoteError& e) {
      PyErr_SetString(remote_error.ptr(), e.what());
    }
  });

  // A C-contiguous float32 array only (the caller handles other dtypes and layouts): no copy.
  m.def("squared_norm", [](py::array_t<float, py::array::c_style> values) {
    const float* data = values.data();
    const int64_t n = values.size();
    py::gil_scoped_release release;
    return buffer_squared_norm(data, n);
  });

  m.def("optimizer_hyperparameters", [](const std::string& name, const std::map<std::string, double>& hparams) {
    return resolve_rule(name, hparams);
  });

  py::class_<PyEngine>(m, "Engine")
      .def(py::init([](py::object comm, double spin_us, double max_sleep_us, double stall_warning_s, double timeout_s,
                       double peer_timeout_s, int64_t max_message_bytes) {
             return std::make_unique<PyEngine>(
                 comm, WaitPolicy{spin_us, max_sleep_us, stall_warning_s, timeout_s, peer_timeout_s}, max_message_bytes);
           }),
           py::arg("comm"), py::arg("spin_us") = 50.0, py::arg("max_sleep_us") = 200.0,
           py::arg("stall_warning_s") = 60.0, py::arg("timeout_s") = 600.0, py::arg("peer_timeout_s") = 60.0,
           py::arg("max_message_bytes") = 0)
      .def_property_readonly("rank", [](PyEngine& e) { return e.client().rank(); })
      .def_property_readonly("size", [](PyEngine& e) { return e.client().size(); })
      .def_property_readonly("usable", [](PyEngine& e) { return nogil([&] { return e.client().usable(); }); })
      .def("add_table", &PyEngine::add_table, py::arg("name"), py::arg("num_rows"), py::arg("dim"),
           py::arg("num_shards") = 0, py::arg("partition") = "cyclic", py::arg("optimizer") = "sgd",
           py::arg("hparams") = std::map<std::string, double>{}, py::arg("dynamic") = py::none(),
           py::arg("storage") = py::none())
      .def("tier_stats", [](PyEngine& e, int t) {
        const TierStats s = nogil([&] { return e.client().tier_stats(t); });
        py::dict d;
        d["dtype"] = s.dtype;
        d["path"] = s.path;
        d["memory_rows"] = s.memory_rows;
        d["disk_rows"] = s.disk_rows;
        d["memory_share"] = s.memory_share;
        d["hits"] = s.hits;
        d["loads"] = s.loads;
        d["bytes_read"] = s.bytes_read;
        d["bytes_written"] = s.bytes_written;
        d["steps"] = s.steps;
        return d;
      }, py::arg("table"), "Local: the table's storage on this rank's shard (rows in memory / on disk, I/O).")
      .def("written_rows", [](PyEngine& e, int t, bool memory) {
        std::vector<int64_t> ids = nogil([&] { return e.client().written_rows(t, memory); });
        const auto n = static_cast<py::ssize_t>(ids.size());
        return to_numpy(std::move(ids), {n});
      }, py::arg("table"), py::arg("memory"),
      "Local (a fixed table with a disk tier): global ids of this shard's rows holding other than their initial "
      "value, in memory or on disk.")
      .def("row_init", [](PyEngine& e, int t) {
        const RowInitSpec s = nogil([&] { return e.client().row_init(t); });
        py::dict d;
        d["kind"] = s.kind;
        d["seed"] = s.seed;
        d["a"] = s.a;
        d["b"] = s.b;
        return d;
      }, py::arg("table"), "Local (a fixed table with a disk tier): how rows never written start: {kind, seed, a, b}.")
      .def("reset_rows", [](PyEngine& e, int t, const std::string& kind, uint64_t seed, double a, double b) {
        nogil([&] { e.client().reset_rows(t, RowInitSpec{kind, seed, a, b}); });
      }, py::arg("table"), py::arg("kind"), py::arg("seed"), py::arg("a"), py::arg("b"),
      "Local: this rank's shard back to the initial values of {kind, seed, a, b}, with fresh optimizer slots.")
      .def("local_rows", &PyEngine::local_rows, py::arg("table"), py::arg("ids"), py::arg("slot") = -1)
      .def("dynamic_state", &PyEngine::dynamic_state, py::arg("table"))
      .def("dynamic_restore", &PyEngine::dynamic_restore, py::arg("table"), py::arg("state"))
      .def("dynamic_range", &PyEngine::dynamic_range, py::arg("table"), py::arg("pending"), py::arg("begin"),
           py::arg("n"), py::arg("rows") = true)
      .def("dynamic_sizes", &PyEngine::dynamic_sizes, py::arg("table"))
      .def("read_dynamic", &PyEngine::read_dynamic, py::arg("table"), py::arg("shard"), py::arg("rows") = true,
           py::arg("slots") = false)
      .def("write_dynamic", &PyEngine::write_dynamic, py::arg("table"), py::arg("state"), py::arg("how"),
           py::arg("step") = -1)
      .def("dynamic_clear", [](PyEngine& e, int t) { nogil([&] { e.client().dynamic_clear(t); }); }, py::arg("table"))
      .def("dynamic_stats", [](PyEngine& e, int t) {
        const DynamicStats s = nogil([&] { return e.client().dynamic_stats(t); });
        py::dict d;
        d["stored"] = s.stored;
        d["capacity"] = s.capacity;
        d["pending"] = s.pending;
        d["admitted"] = s.admitted;
        d["evicted"] = s.evicted;
        d["expired"] = s.expired;
        d["rejected"] = s.rejected;
        d["last_admitted"] = s.last_admitted;
        d["last_evicted"] = s.last_evicted;
        d["last_expired"] = s.last_expired;
        d["map_bytes"] = s.map_bytes;
        d["row_bytes"] = s.row_bytes;
        return d;
      })
      .def("pull", &PyEngine::pull, py::arg("tables"), py::arg("ids"), py::arg("in_order") = std::vector<bool>{},
           py::arg("error") = "")
      .def("lookup", &PyEngine::lookup, py::arg("table"), py::arg("ids"), py::arg("error") = "")
      .def("push", &PyEngine::push, py::arg("tables"), py::arg("ids"), py::arg("grads"),
           py::arg("scale") = 1.0f, py::arg("return_updates") = false, py::arg("lrs") = py::none())
      .def("set_rule", [](PyEngine& e, int t, const std::string& rule, const std::map<std::string, double>& hparams) {
             nogil([&] { e.client().set_rule(t, rule, hparams); });
           }, py::arg("table"), py::arg("optimizer"), py::arg("hparams") = std::map<std::string, double>{})
      .def("barrier", [](PyEngine& e, const std::string& what) { nogil([&] { e.client().barrier(what); }); },
           py::arg("what") = "flush", "Collective: returns once every operation started anywhere is applied.")
      .def("flush", [](PyEngine& e) { nogil([&] { e.client().barrier("flush"); }); })
      .def("rescale_accumulators", [](PyEngine& e, const std::vector<int>& tables, double factor) {
             nogil([&] { e.client().rescale_accumulators(tables, factor); });
           }, py::arg("tables"), py::arg("factor"),
           "Collective: the tables' accumulating server-optimizer slots (Adagrad's sums) times factor, every "
           "stored row, between the pushes before and after it.")
      .def("close", [](PyEngine& e) { nogil([&] { e.client().close(); }); },
           "Stops serving the peers (after a last barrier); later calls raise.")
      .def("attach_replica", &PyEngine::attach_replica, py::arg("table"), py::arg("replica"))
      .def("write_local", &PyEngine::write_local, py::arg("table"), py::arg("ids"), py::arg("rows"),
           py::arg("slot") = -1)
      .def("local_values", &PyEngine::local_values, py::arg("table"), py::arg("slot") = -1)
      .def("rename_table", [](PyEngine& e, int t, const std::string& name) { nogil([&] { e.client().rename_table(t, name); }); })
      .def("drop_table", [](PyEngine& e, int t) { nogil([&] { e.client().drop_table(t); }); })
      .def("load_from_root", &PyEngine::load_from_root, py::arg("table"), py::arg("values"), py::arg("root") = 0,
           py::arg("consume") = false)
      .def("load_local", &PyEngine::load_local, py::arg("table"), py::arg("slot"), py::arg("values"))
      .def("init_normal", [](PyEngine& e, int t, uint64_t seed, float mean, float std) {
             nogil([&] { e.client().init_normal(t, seed, mean, std); });
           }, py::arg("table"), py::arg("seed"), py::arg("mean") = 0.0f, py::arg("std") = 1.0f)
      .def("init_uniform", [](PyEngine& e, int t, uint64_t seed, float low, float high) {
             nogil([&] { e.client().init_uniform(t, seed, low, high); });
           }, py::arg("table"), py::arg("seed"), py::arg("low"), py::arg("high"))
      .def("read_table", &PyEngine::read_table, py::arg("table"), py::arg("slot") = -1, py::arg("hand_over") = false,
           "One-sided: the whole table (or a slot) from its shards, on this rank only. hand_over: collective "
           "before the table is dropped; the shards free what every rank has read.")
      .def("read_rows", &PyEngine::read_rows, py::arg("table"), py::arg("ids"), py::arg("slot") = -1,
           "One-sided: rows (or slot values) of ids from whichever shards hold them.")
      .def("write_table", &PyEngine::write_table, py::arg("table"), py::arg("values"), py::arg("slot") = -1,
           "One-sided: the whole table (or a slot) written to its shards.")
      .def("write_rows", &PyEngine::write_rows, py::arg("table"), py::arg("ids"), py::arg("rows"),
           py::arg("slot") = -1, "One-sided: rows (or slot values) of ids written to whichever shards hold them.")
      .def("join_begin", [](PyEngine& e) { nogil([&] { e.client().join_begin(); }); })
      .def("join_finish", [](PyEngine& e) { nogil([&] { e.client().join_finish(); }); })
      .def("table_step", [](PyEngine& e, int t) { return nogil([&] { return e.client().table_step(t); }); },
           py::arg("table"), "One-sided: the table's server-optimizer step (from a shard's owner).")
      .def("set_table_step", [](PyEngine& e, int t, int64_t step) { nogil([&] { e.client().set_table_step(t, step); }); },
           py::arg("table"), py::arg("step"), "One-sided: sets the server-optimizer step on every shard of the table.")
      .def("round_stats", [](PyEngine& e, int t) {
        const RoundStats s = nogil([&] { return e.client().round_stats(t); });
        py::dict d;
        d["round"] = s.round;
        d["local_sq"] = s.local_sq;
        d["combined_sq"] = s.combined_sq;
        d["ranks"] = s.ranks;
        d["rows"] = s.rows;
        d["pushed"] = s.pushed;
        return d;
      }, py::arg("table"), "The newest complete push round's gradient statistics of the table (round -1: none), "
                           "with its distinct rows and the rows it received (each rank's distinct rows, summed).")
      .def("set_gradient_statistics", [](PyEngine& e, int t, bool on) {
             nogil([&] { e.client().set_gradient_statistics(t, on); });
           }, py::arg("table"), py::arg("on"),
           "Local (every rank alike): whether the table's shards compute round_stats' squared norms.")
      .def("set_staleness", [](PyEngine& e, int t, int k) { nogil([&] { e.client().set_staleness(t, k); }); },
           py::arg("table"), py::arg("k"), "Local (every rank alike): the table's bounded staleness (0: synchronous).")
      .def("staleness", [](PyEngine& e, int t) {
        const StalenessStats s = nogil([&] { return e.client().staleness(t); });
        py::dict d;
        d["staleness"] = s.staleness;
        d["clock"] = s.clock;
        d["pulls"] = s.pulls;
        d["last_lag"] = s.last_lag;
        d["max_lag"] = s.max_lag;
        d["lag_sum"] = s.lag_sum;
        d["held"] = s.held;
        d["wait_s"] = s.wait_s;
        return d;
      }, py::arg("table"), "The table's bounded staleness and the lag this rank's pulls saw.")
      .def("set_step", [](PyEngine& e, int t, int64_t step) { nogil([&] { e.client().set_step(t, step); }); })
      .def("step", [](PyEngine& e, int t) { return nogil([&] { return e.client().step(t); }); })
      .def("spec", [](PyEngine& e, int t) {
        const TableSpec s = e.spec(t);
        py::dict d;
        d["name"] = s.name;
        d["num_rows"] = s.num_rows;
        d["dim"] = s.dim;
        d["num_shards"] = s.num_shards;
        d["partition"] = s.partition == PartitionKind::kCyclic ? "cyclic" : s.partition == PartitionKind::kHash ? "hash" : "block";
        d["dynamic"] = s.dynamic.on;
        d["optimizer"] = s.rule;
        d["hparams"] = s.hparams;
        py::dict st;
        st["dtype"] = s.storage.dtype;
        st["rounding"] = s.storage.rounding;
        st["memory_rows"] = s.storage.memory_rows;
        st["disk_rows"] = s.storage.disk_rows;
        st["path"] = s.storage.path;
        st["seed"] = s.storage.seed;
        d["storage"] = st;
        return d;
      })
      .def("slot_names", [](PyEngine& e, int t) { return nogil([&] { return e.client().slot_names(t); }); })
      .def("hyperparameters", [](PyEngine& e, int t) { return nogil([&] { return e.client().hyperparameters(t); }); })
      .def("shard_rows", [](PyEngine& e, int t) { return nogil([&] { return e.client().shard_rows(t); }); })
      .def("row_store_bytes", [](PyEngine& e) { return nogil([&] { return e.client().row_store_bytes(); }); })
      .def("state_bytes", [](PyEngine& e) { return nogil([&] { return e.client().state_bytes(); }); })
      .def("traffic", [](PyEngine& e) {
        const TrafficStats t = nogil([&] { return e.client().traffic(); });
        py::dict d;
        d["bytes_sent"] = t.bytes_sent;
        d["bytes_received"] = t.bytes_received;
        d["messages_sent"] = t.messages_sent;
        d["largest_message"] = t.largest_message;
        return d;
      })
      .def("reset_traffic", [](PyEngine& e) { nogil([&] { e.client().reset_traffic(); }); })
      .def("set_tracing", [](PyEngine& e, bool on) { nogil([&] { e.client().set_tracing(on); }); })
      .def("take_trace", [](PyEngine& e) {
        const std::vector<TraceEvent> events = nogil([&] { return e.client().take_trace(); });
        py::list out;
        for (const TraceEvent& ev : events) out.append(py::make_tuple(ev.name, ev.start_ns, ev.end_ns, ev.rows));
        return out;
      });
}
