"""HYBRIDSYNC_TIMELINE writes a Chrome trace of every step's phases, per rank, merged by rank 0."""
import json

from tests.parallel.harness import run_program


def test_timeline_has_every_phase_of_every_rank(tmp_path):
    trace = tmp_path / "trace.json"
    run_program(2, "examples/torch_dlrm.py", "--rows", "2000", "--steps", "6", "--log-every", "6",
                env={"HYBRIDSYNC_TIMELINE": str(trace), "HYBRIDSYNC_BACKEND": "mpi"})
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    for rank in (0, 1):
        names = {e["name"] for e in spans if e["pid"] == rank}
        for phase in ("forward", "backward", "synchronize", "optimizer update (dense)", "pull (8 tables)",
                      "push (8 tables)", "server apply", "serve pulls"):
            assert phase in names, (rank, phase, sorted(names))
        assert any(n.startswith("all-reduce") for n in names), names
    # Spans nest in time: each step's pull lies inside a forward of the same rank.
    for rank in (0, 1):
        forwards = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["pid"] == rank and e["name"] == "forward"]
        pulls = [e for e in spans if e["pid"] == rank and e["name"] == "pull (8 tables)"]
        assert pulls and all(any(a <= p["ts"] <= b for a, b in forwards) for p in pulls)
    # The MPI backend posts the fused dense all-reduce from a gradient hook, inside backward, at
    # every step after the first (which agrees on the plan first).
    for rank in (0, 1):
        backwards = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["pid"] == rank and e["name"] == "backward"]
        starts = [e for e in spans if e["pid"] == rank and e["name"].startswith("all-reduce start")]
        assert len(starts) == 5, [e["name"] for e in spans if e["pid"] == rank and "all-reduce" in e["name"]]
        assert all(any(a <= s["ts"] <= b for a, b in backwards) for s in starts), (starts, backwards)
    assert (tmp_path / "trace.rank0.json").exists() and (tmp_path / "trace.rank1.json").exists()
