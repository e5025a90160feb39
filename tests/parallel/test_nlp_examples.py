"""The NLP examples (examples/torch_word2vec.py, examples/torch_lm.py) and tied embeddings.

Each example runs as a user runs it, under `mpirun -np 2`: the plan is printed, the loss falls,
and its final tables, dense weights and per-step losses match the same script run in one process
with plain torch (`--plain-torch`, no hybridsync) on the same global batch (2 x the per-rank
batch). The parity runs use small vocabularies so that each test stays well under 30 s.

Tied weights on the parameter server (the rank scenarios below): a sparse embedding module
called twice per step, two sparse embedding modules (Embedding and EmbeddingBag) sharing one
weight, and an nn.Linear output layer sharing the embedding's weight (dense gradient) train
exactly as one process does, sharded and replicated, at -np 2 and 3; code that reads a sharded
table's `.weight` gets an error that says why and what to do.
"""
from __future__ import annotations

import re
import sys

import pytest

from tests.parallel.harness import launch, rank_main, run_program, run_ranks

LOCAL_BATCH_W2V, LOCAL_BATCH_LM = 256, 64
W2V_ARGS = ["--vocab", "20000", "--tokens", "200000", "--dim", "16", "--steps", "40", "--log-every", "10"]
LM_ARGS = ["--vocab", "20000", "--tokens", "200000", "--dim", "16", "--hidden", "32", "--sampled", "256",
           "--steps", "40", "--log-every", "10"]


def _losses(out):
    return [float(x) for x in re.findall(r"step\s+\d+\s+loss ([0-9.]+)", out)]


def _untag(out):
    """The output without mpirun's --tag-output prefixes ("[1,0]<stdout>:")."""
    return re.sub(r"^\[\d+,\d+\]<std(?:out|err)>:", "", out, flags=re.M)


def _plan_row(out, name):
    rows = [line.split() for line in _untag(out).splitlines() if line.split()[:1] == [name]]
    assert rows, f"no plan row for {name}:\n{out}"
    return rows[0]


def _hybrid_and_reference(tmp_path, script, local_batch, *args):
    """Runs the example on 2 ranks x local_batch and in one plain-torch process x 2*local_batch;
    returns both outputs and both dumps (final parameters, each step's global-batch loss)."""
    import torch

    hybrid, reference = tmp_path / "hybrid.pt", tmp_path / "reference.pt"
    out = run_program(2, script, *args, "--batch-size", str(local_batch), "--dump", str(hybrid), timeout=120)
    rc, ref_out = launch([sys.executable, "-u", script, *args, "--plain-torch", "--batch-size", str(2 * local_batch),
                          "--dump", str(reference)], timeout=120)
    assert rc == 0, ref_out
    return out, ref_out, torch.load(hybrid, weights_only=True), torch.load(reference, weights_only=True)


def _assert_parity(got, want, tables, out):
    """Every step's loss and every dense weight agree to float32 rounding. Rows of the embedding
    tables get 5e-4: a rare row's first Adagrad steps divide its gradient by that gradient's own
    norm, which amplifies rounding (plain torch alone, batch 128 vs 2 micro-batches of 64, differs
    by 2e-5 on ~40 of 320,000 elements after 60 steps; the hybrid run by up to 1e-4 on ~60-90). A
    lost, doubled or misrouted gradient row moves a row by about the learning rate (0.1-0.2)."""
    import torch

    assert set(got["params"]) == set(want["params"]), (sorted(got["params"]), sorted(want["params"]))
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=1e-5)
    for key in want["params"]:
        torch.testing.assert_close(got["params"][key], want["params"][key], rtol=1e-4,
                                   atol=5e-4 if key in tables else 1e-5,
                                   msg=lambda m, key=key: f"{key}: {m}\n{out}")


@pytest.mark.parametrize("optimizer,placement", [("adagrad", "sharded"), ("sgd", "replicated")])
def test_word2vec_trains_and_matches_one_process(tmp_path, optimizer, placement):
    out, ref_out, got, want = _hybrid_and_reference(
        tmp_path, "examples/torch_word2vec.py", LOCAL_BATCH_W2V, *W2V_ARGS, "--optimizer", optimizer,
        "--placement", placement)
    for table in ("in_vectors.weight", "out_vectors.weight"):
        row = _plan_row(out, table)
        assert row[2:5] == ["sparse", "ps", placement] and row[6].startswith(optimizer), row
    # The loss falls: fast with Adagrad, slowly with SGD (its step is capped by the hottest words).
    losses = _losses(out)
    assert len(losses) == 4 and losses == sorted(losses, reverse=True), out
    assert losses[-1] < (0.8 if optimizer == "adagrad" else 0.95) * losses[0], out
    assert losses == pytest.approx(_losses(ref_out), abs=2e-4), (out, ref_out)
    after, untrained = map(float, re.search(r"held-out loss after training ([0-9.]+) \(untrained: ([0-9.]+)\)",
                                            out).groups())
    assert after < untrained - 0.15, out
    _assert_parity(got, want, {"in_vectors.weight", "out_vectors.weight"}, out)


@pytest.mark.parametrize("tied,placement", [(False, "sharded"), (True, "sharded"), (True, "replicated")])
def test_lm_sampled_softmax_trains_and_matches_one_process(tmp_path, tied, placement):
    args = [*LM_ARGS, "--placement", placement] + (["--tied"] if tied else [])
    out, ref_out, got, want = _hybrid_and_reference(tmp_path, "examples/torch_lm.py", LOCAL_BATCH_LM, *args)
    tables = ["embed.weight", "bias.weight"] + ([] if tied else ["out.weight"])
    for table in tables:
        assert _plan_row(out, table)[2:5] == ["sparse", "ps", placement], out
    assert _plan_row(out, "mlp.0.weight")[2:4] == ["dense", "allreduce"], out
    plan = [line.split()[0] for line in _untag(out).splitlines() if line.split()[:1] and ".weight" in line.split()[0]]
    assert ("out.weight" in plan) is not tied, out  # tied: one variable, one table on the PS
    losses = _losses(out)
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], out
    assert losses == pytest.approx(_losses(ref_out), abs=2e-4), (out, ref_out)
    # The full softmax on held-out text: a perplexity far below an untrained model's (~vocab)
    perplexity = float(re.search(r"held-out perplexity after training ([0-9.,]+)", out).group(1).replace(",", ""))
    assert perplexity < 0.2 * 20000, out
    _assert_parity(got, want, set(tables + ["out.weight"]), out)
    if tied:  # both names hold the one table, in the hybrid run too
        assert got["params"]["out.weight"].equal(got["params"]["embed.weight"])


# -- tied weights in the library: rank scenarios -------------------------------------------------
VOCAB, DIM, CONTEXT, LOCAL, STEPS, CANDIDATES = 30, 4, 3, 4, 6, 10
TIES = ("module", "parameter", "bag", "linear")


def _tied_model(tie):
    """Context words -> mean embedding -> Linear -> h; logits <h, output row> for the step's
    candidate words (rows of the same table), or a full softmax through a tied nn.Linear."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, DIM, sparse=True)
            self.mix = torch.nn.Linear(DIM, DIM)
            if tie == "module":  # one module, called twice per step
                self.out = self.emb
            elif tie == "parameter":  # two modules, one weight
                self.out = torch.nn.Embedding(VOCAB, DIM, sparse=True)
                self.out.weight = self.emb.weight
            elif tie == "bag":
                self.out = torch.nn.EmbeddingBag(VOCAB, DIM, mode="sum", sparse=True)
                self.out.weight = self.emb.weight
            else:  # the classic tied LM: a full-softmax nn.Linear whose weight is the embedding's
                self.out = torch.nn.Linear(DIM, VOCAB, bias=False)
                self.out.weight = self.emb.weight

        def forward(self, context, candidates):
            h = self.mix(self.emb(context).mean(1))
            if tie == "linear":
                return self.out(h)[:, candidates]
            rows = self.out(candidates[:, None]) if tie == "bag" else self.out(candidates)
            return h @ rows.T

    torch.manual_seed(3)
    return Net()


def _tied_batch(step, n):
    """A global batch whose context words and candidate rows overlap: the same rows get
    gradient from both uses of the tied table, on every rank."""
    import torch

    g = torch.Generator().manual_seed(100 + step)
    context = torch.randint(0, 8, (n, CONTEXT), generator=g)
    context[:, -1] = torch.randint(0, VOCAB, (n,), generator=g)
    candidates = torch.randperm(VOCAB, generator=g)[:CANDIDATES]
    target = torch.randint(0, CANDIDATES, (n,), generator=g)
    return context, candidates, target


def _train_tied(tie, placement, rank, size):
    import torch
    import torch.nn.functional as F

    import hybridsync.torch as hvd

    model = _tied_model(tie)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    if placement == "sharded":
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), model=model)
    elif placement == "replicated":
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    for step in range(STEPS):
        context, candidates, target = _tied_batch(step, LOCAL * size)
        if placement is not None:
            part = slice(rank * LOCAL, (rank + 1) * LOCAL)
            context, target = context[part], target[part]
        opt.zero_grad()
        F.cross_entropy(model(context, candidates), target).backward()
        opt.step()
    return model, opt


def rank_tied_parity():
    import torch

    import hybridsync.torch as hvd
    from hybridsync.torch.embedding import PS_MODULES

    rank, size = hvd.rank(), hvd.size()
    for tie in TIES:
        reference, _ = _train_tied(tie, None, rank, size)
        want = {k: v.detach().clone() for k, v in reference.state_dict().items()}
        for placement in ("sharded", "replicated"):
            model, opt = _train_tied(tie, placement, rank, size)
            got = model.state_dict()
            assert set(got) == set(want), (tie, placement, sorted(got))
            for key in want:
                torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6,
                                           msg=lambda m, key=key: f"{tie}/{placement} {key}: {m}")
            plan = {v.name: v for v in opt.plan.variables}
            assert "out.weight" not in plan, sorted(plan)  # one parameter, one variable
            v = plan["emb.weight"]
            if tie == "linear":  # the Linear's gradient is dense: all-reduced, never swapped
                assert (v.kind.value, v.route.value) == ("dense", "allreduce"), v
                assert not isinstance(model.emb, PS_MODULES)
                if placement == "sharded":
                    assert "tied" in v.reason and "'out' (Linear)" in v.reason, v.reason
            else:
                assert (v.kind.value, v.route.value, v.placement.value) == ("sparse", "ps", placement), v
            if tie != "linear" and placement == "sharded":  # every module reads the one table
                assert isinstance(model.emb, PS_MODULES) and isinstance(model.out, PS_MODULES)
                assert model.out.table is model.emb.table
        print(f"rank {rank}: tied by {tie}: sharded and replicated match the {size * LOCAL}-sample run", flush=True)


def rank_sharded_weight_access_is_explained():
    import torch
    import torch.nn.functional as F

    import hybridsync.torch as hvd

    class ReadsWeight(torch.nn.Module):  # a tied output written with the weight tensor itself
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, DIM, sparse=True)

        def forward(self, context, candidates):
            return self.emb(context).mean(1) @ F.embedding(candidates, self.emb.weight).T

    model = ReadsWeight()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    context, candidates, _ = _tied_batch(0, LOCAL)
    with pytest.raises(AttributeError, match=r"PS embedding 'emb.weight' has no local weight.*placement: replicated"):
        model(context, candidates)
    assert not hasattr(model.emb, "weight")
    del opt


@pytest.mark.parametrize("np_", [2, 3])
def test_tied_tables_match_one_process(np_):
    out = run_ranks(__file__, "rank_tied_parity", np_, timeout=180)
    assert out.count("tied by") == len(TIES) * np_, out


def test_reading_a_sharded_tables_weight_is_an_error_that_says_why():
    run_ranks(__file__, "rank_sharded_weight_access_is_explained", 2, timeout=120)


if __name__ == "__main__":
    rank_main(globals())
