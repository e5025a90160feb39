"""The side-by-side benchmarks' report code (no benchmark runs): the README's headline table with
and without TorchRec, the side-by-side table and TorchRec's plan, the TorchRec venv check, and the
kernel benchmark's cachegrind parsing."""
import pytest

from benchmarks import bench, headline, kernels, torchrec_launch


def _summary(system, ranks, samples_per_s, rss_mib=500, saved=None, plan=None):
    s = {"system": system, "ranks": ranks, "samples_per_s": samples_per_s, "ms_per_step": 512 * ranks * 1e3 / samples_per_s,
         "peak_rss_per_rank": rss_mib * 2**20, "rss_saved_vs_horovod": saved, "scaling": None}
    if plan:
        s["plan"] = plan
    return s


def _results(with_torchrec):
    one_host = [_summary("hybridsync-sharded", 2, 200_000), _summary("horovod-allgather", 2, 100_000),
                _summary("horovod-allgather-yield", 2, 150_000), _summary("hybridsync-sharded", 4, 170_000, 500, 0.78),
                _summary("horovod-allgather", 4, 110_000, 690), _summary("horovod-allgather-yield", 4, 112_000, 690)]
    if with_torchrec:
        one_host += [_summary("torchrec-cpu", 2, 250_000), _summary("torchrec-cpu", 4, 90_000, 800)]
    network = [{"rate": "1gbit", "per_host": 2, "system": "hybridsync-sharded", "samples_per_s": 140_000},
               {"rate": "1gbit", "per_host": 2, "system": "horovod-allgather-yield", "samples_per_s": 70_000}]
    return {"meta": {"repeats": 3}, "summary": one_host}, {"meta": {"repeats": 2}, "summary": network}


def test_the_headline_says_torchrec_is_not_yet_measured_until_a_run_has_it():
    text = headline.table("hybridsync-sharded", *_results(with_torchrec=False))
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in text.splitlines() if line.startswith("| ")}
    assert rows["2 ranks, one host"][1:4] == ["200,000", "100,000", "150,000"]
    assert rows["2 ranks, one host"][4] == headline.MISSING
    assert rows["2 ranks, one host"][5].startswith("1.33x")  # vs Horovod at its best, the only baseline measured
    assert rows["2 hosts x 2 ranks, 1 Gbit links"][2] == headline.MISSING  # Horovod allgather not in this file
    assert rows["peak memory per rank, 4 ranks"][-1].startswith("0.78 tables less")


def test_the_headline_compares_with_the_fastest_baseline_torchrec_included():
    text = headline.table("hybridsync-sharded", *_results(with_torchrec=True))
    two = next(line for line in text.splitlines() if line.startswith("| 2 ranks, one host"))
    assert "250,000" in two and two.endswith("| 0.80x |")  # TorchRec is the faster baseline at 2 ranks
    four = next(line for line in text.splitlines() if line.startswith("| 4 ranks"))
    assert four.endswith("| 1.52x |")  # Horovod at its best is, at 4
    assert "800 MiB" in text


def test_the_side_by_side_table_names_the_sharding_torchrec_chose():
    plan = "param | sharding type | compute kernel | ranks\nt0    | table_wise    | fused          | [0]"
    summary = [_summary("hybridsync-default", 1, 140_000), _summary("hybridsync-default", 2, 250_000),
               _summary("torchrec-cpu", 2, 100_000, plan=plan)]
    summary[1]["scaling"] = 250_000 / 140_000
    text = bench.side_by_side(summary)
    assert "| hybridsync default | TorchRec CPU |" in text
    assert "(1.79x)" in text
    assert "TorchRec's default planner at 2 rank(s): table_wise sharding." in text


def test_a_missing_torchrec_venv_is_an_error_saying_how_to_build_one(tmp_path):
    with pytest.raises(torchrec_launch.TorchRecMissing, match="scripts/torchrec-venv.sh"):
        torchrec_launch.python(str(tmp_path / "no-such-python"))


def test_cachegrind_counts_are_summed_per_function():
    text = ("events: Ir D1mr DLmr\nfl=a.cc\nfn=???:hybridsync::RowAggregator::add(hybridsync::GradientRows const&)\n"
            "10 100 2 1\n11 50\nfn=???:hybridsync::(anonymous namespace)::SGDRule::apply(float*, long) const\n3 7 1\n"
            "summary: 157 3 1\n")
    counts = kernels.per_function(text)
    assert counts["???:hybridsync::RowAggregator::add(hybridsync::GradientRows const&)"] == {"Ir": 150, "D1mr": 2, "DLmr": 1}
    assert [kernels.short_name(f) for f in counts] == ["RowAggregator::add", "SGDRule::apply"]


def test_the_headline_leaves_out_a_baseline_neither_run_measured():
    bench_results, network = _results(with_torchrec=True)
    bench_results["summary"] = [s for s in bench_results["summary"] if s["system"] != "horovod-allgather"]
    text = headline.table("hybridsync-sharded", bench_results, network)
    header = next(line for line in text.splitlines() if line.startswith("| setting"))
    assert "Horovod allgather" not in header and "Horovod at its best" in header and "TorchRec CPU" in header
    two = next(line for line in text.splitlines() if line.startswith("| 2 ranks, one host")).split(" | ")
    assert two[1:4] == ["200,000", "150,000", "250,000"]
    assert two[4].startswith("0.80x")  # against TorchRec, the fastest baseline of the row


def _span(name, start_us, dur_us, cat="phase"):
    return {"name": name, "cat": cat, "ph": "X", "pid": 0, "tid": 0, "ts": float(start_us), "dur": float(dur_us)}


def test_the_profile_cuts_each_timed_step_into_its_phases():
    from benchmarks import profile_step

    def one_step(t):  # a 10,000 us step starting at t
        return [_span("forward", t, 3000), _span("pull (8 tables)", t + 100, 800, "ps"),
                _span("backward", t + 3000, 4000), _span("all-reduce start (6 tensors fused)", t + 6500, 300, "dense"),
                _span("synchronize", t + 7000, 2000), _span("push (8 tables)", t + 7100, 500, "ps"),
                _span("all-reduce wait (6 tensors fused, mpi)", t + 7700, 1000, "dense"),
                _span("optimizer update (dense)", t + 9000, 600),
                _span("serve pulls", t + 200, 50, "server"), _span("server apply", t + 7300, 150, "server")]

    warmup = [_span("forward", -50_000, 20_000), _span("pull embeddings.0.weight", -49_000, 9000, "ps")]
    events = warmup + one_step(0) + one_step(10_000)
    phases = profile_step.phases_of_trace(events, steps=2)
    expected = {"forward (model)": 2.2, "PS pull": 0.8, "backward (model)": 3.7, "dense all-reduce": 1.3, "PS push": 0.5,
                "rest of synchronize": 0.5, "dense update": 0.6, "server: serve pulls": 0.05,
                "server: apply pushes": 0.15}
    for phase, ms in expected.items():
        assert phases[phase] == pytest.approx(ms), phase
    # the last step ends with its dense update: 19,600 us for two steps, 0.4 ms each outside the spans
    assert phases["around the optimizer"] == pytest.approx((19_600 - 2 * 9_600) / 1e3 / 2)
    with pytest.raises(ValueError, match="fewer than the 3 timed steps"):
        profile_step.phases_of_trace(one_step(0), steps=3)
