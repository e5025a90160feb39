// The Python module hybridsync._liveness: this process's heartbeat (peers' liveness) and the
// last words its watchdog says before it ends the job over a lost host (hybridsync/liveness.h).
// Apart from the engine's module: liveness serves the MPI backend too, with or without tables.
#include <mpi4py/mpi4py.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "hybridsync/liveness.h"
#include "transport/heartbeat.h"

namespace py = pybind11;
using namespace hybridsync;

namespace {

template <class F>
auto nogil(F&& f) {
  py::gil_scoped_release release;
  return f();
}

}  // namespace

PYBIND11_MODULE(_liveness, m) {
  m.doc() = "hybridsync peer liveness: heartbeat and lost-host last words (C++)";
  if (import_mpi4py() < 0) throw py::error_already_set();
  m.def("start_heartbeat", [](py::object comm, double interval_s, double abort_after_s) {
        MPI_Comm* c = PyMPIComm_Get(comm.ptr());
        if (!c) throw py::error_already_set();
        nogil([&] { start_heartbeat(*c, interval_s, abort_after_s); });
      }, py::arg("comm"), py::arg("interval_s"), py::arg("abort_after_s") = 0.0,
      "Collective: starts this process's heartbeat thread (peers' liveness, see silent_peers); "
      "abort_after_s > 0: a peer silent that long aborts the job, naming it.");
  m.def("set_lost_host_last_words", &set_lost_host_last_words, py::arg("advice"), py::arg("advice_claim"),
        py::arg("backstop"), py::arg("backstop_note"),
        "What the heartbeat's watchdog writes and starts just before it aborts the job over a peer on another "
        "host (hybridsync/liveness.h); empty strings and list: nothing.");
  m.def("first_on_this_host", &first_on_this_host, py::arg("name"),
        "Whether this process is the first on its host to claim `name` (held until it ends).");
  m.def("stop_heartbeat", [] { nogil([] { stop_heartbeat(); }); });
  m.def("silent_peers", [](double timeout_s) {
        py::list out;
        for (const SilentPeer& p : silent_peers(timeout_s)) out.append(py::make_tuple(p.rank, p.host, p.seconds));
        return out;
      }, py::arg("timeout_s"), "(rank, host, seconds) of peers not heard from for longer than timeout_s.");
  m.def("departed_peers", [](double grace_s) {
        py::list out;
        for (int p = 0; p < heartbeat_size(); ++p) {
          const double s = departed_for(p);
          if (s > grace_s) out.append(py::make_tuple(p, host_of(p), s));
        }
        return out;
      }, py::arg("grace_s"), "(rank, host, seconds) of peers that said goodbye (ended normally) over grace_s ago.");

}
