"""Skip-gram word2vec with negative sampling on synthetic Zipfian text, trained with hybridsync.

The model is two embedding tables and nothing else: input vectors (the centre word) and output
vectors (context and noise words), each `--vocab` x `--dim` (default 200,000 x 64), built as
nn.Embedding(sparse=True). A step touches a few thousand of their rows, most of them the same
few hot words (ids ~ Zipf(1.1)); both tables live on the parameter server, sharded over the
ranks, and each rank sends each touched row's gradient once, to the shard that owns it. This is
Parallax's home ground: a model that is almost all sparse parameters.

Each step draws one global batch of (centre, context) pairs from the text, with `--negatives`
noise words per pair from the unigram distribution raised to 0.75 (Mikolov et al.); rank r
trains on its slice, so N ranks x `--batch-size` b see exactly what one process with batch N*b
sees (`--plain-torch` runs that process without hybridsync: the tests compare the two).

    mpirun -np 2 python examples/torch_word2vec.py              # as root: mpirun --allow-run-as-root
    horovodrun -np 2 python examples/torch_word2vec.py --steps 3000 --placement replicated
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from zipf_text import ZipfText, sample


class SkipGram(nn.Module):
    """score(centre, word) = <input vector of centre, output vector of word>."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.in_vectors = nn.Embedding(vocab, dim, sparse=True)
        self.out_vectors = nn.Embedding(vocab, dim, sparse=True)
        # word2vec's initialisation: small random input vectors, zero output vectors.
        nn.init.uniform_(self.in_vectors.weight, -0.5 / dim, 0.5 / dim)
        nn.init.zeros_(self.out_vectors.weight)

    def forward(self, centre, words):
        """centre: (B,) ids; words: (B, 1 + K) ids, the context word then K noise words.
        Returns (B, 1 + K) scores."""
        u = self.in_vectors(centre)  # (B, dim)
        v = self.out_vectors(words)  # (B, 1 + K, dim)
        return torch.bmm(v, u.unsqueeze(2)).squeeze(2)


def negative_sampling_loss(scores):
    """-log sigmoid(context score) - sum over noise words of log sigmoid(-noise score), averaged."""
    return -(F.logsigmoid(scores[:, 0]) + F.logsigmoid(-scores[:, 1:]).sum(1)).mean()


class SkipGramBatches:
    """Step s's global batch depends only on (seed, s): every rank draws the same one and keeps
    its slice, whatever the number of ranks."""

    def __init__(self, text: ZipfText, window: int, negatives: int, seed: int):
        self.text, self.window, self.negatives, self.seed = text, window, negatives, seed
        noise = text.counts.astype(np.float64) ** 0.75
        self.noise_cdf = np.cumsum(noise / noise.sum())

    def pairs(self, tokens, rng, n):
        centre_at = rng.integers(self.window, len(tokens) - self.window, n)
        offset = rng.integers(1, self.window + 1, n) * rng.choice(np.array([-1, 1]), n)
        return tokens[centre_at], tokens[centre_at + offset]

    def batch(self, step: int, global_batch: int, rank: int, local_batch: int, held_out: bool = False):
        rng = np.random.default_rng([self.seed, step, int(held_out)])
        centre, context = self.pairs(self.text.test if held_out else self.text.train, rng, global_batch)
        noise = sample(self.noise_cdf, rng, (global_batch, self.negatives))
        part = slice(rank * local_batch, (rank + 1) * local_batch)
        words = np.concatenate([context[:, None], noise], axis=1)
        return torch.from_numpy(centre[part]), torch.from_numpy(words[part])


def staleness_lines(optimizer) -> list:
    """What this rank's pulls of each table with bounded staleness missed (docs/staleness.md)."""
    plan = getattr(optimizer, "plan", None)
    bounded = [v for v in (plan.variables if plan else []) if getattr(v, "staleness", 0)]
    if not bounded:
        return []
    from hybridsync.planning.report import describe_staleness

    return ["staleness: " + describe_staleness(v) for v in bounded]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=1024, help="(centre, context) pairs per rank")
    parser.add_argument("--vocab", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=2_000_000, help="length of the synthetic text")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of word frequencies")
    parser.add_argument("--window", type=int, default=3)
    parser.add_argument("--negatives", type=int, default=5, help="noise words per pair")
    parser.add_argument("--optimizer", choices=["adagrad", "sgd"], default="adagrad")
    parser.add_argument("--lr", type=float, default=None, help="default: 0.2 for adagrad, 20 for sgd (the loss "
                        "is a mean over the batch: SGD needs a large step, and diverges on hot words above ~30)")
    parser.add_argument("--placement", choices=["sharded", "replicated"], default="sharded")
    parser.add_argument("--config", default=None, help="YAML config with per-variable overrides")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slow-ms", type=float, default=0.0,
                        help="a straggler: the last rank sleeps this long every step (a slow data loader; see "
                             "docs/staleness.md)")
    parser.add_argument("--plain-torch", action="store_true",
                        help="train in this one process with plain torch, no hybridsync: the reference "
                             "that N ranks x --batch-size b must match with --batch-size N*b")
    parser.add_argument("--horovod", action="store_true",
                        help="train with horovod.torch itself (sparse gradients all-gathered), for comparisons")
    parser.add_argument("--dump", metavar="PATH", default=None,
                        help="save the final tables and the per-step losses here (torch.save)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="tqdm progress bar on rank 0 (default: when stderr is a terminal; under mpirun "
                             "it is a pipe)")
    args = parser.parse_args()
    lr = args.lr if args.lr is not None else {"adagrad": 0.2, "sgd": 20.0}[args.optimizer]

    torch.set_num_threads(1)
    if args.plain_torch:
        hvd, rank, size = None, 0, 1
    else:
        if args.horovod:
            import horovod.torch as hvd
        else:
            import hybridsync.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(args.seed)
    text = ZipfText(args.vocab, args.tokens, args.zipf, seed=args.seed)
    data = SkipGramBatches(text, args.window, args.negatives, args.seed)
    model = SkipGram(args.vocab, args.dim)
    optimizer = (torch.optim.Adagrad if args.optimizer == "adagrad" else torch.optim.SGD)(model.parameters(), lr=lr)
    if hvd is not None:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # model=model: both tables are sharded on the parameter server (each rank holds 1/N);
        # without it (--placement replicated) every rank keeps a replica, as with Horovod.
        placed = {} if args.horovod else {"model": model if args.placement == "sharded" else None,
                                          "config": args.config}
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), **placed)

    def average(value: float) -> float:
        return value if hvd is None else hvd.allreduce(torch.tensor(value), name="loss").item()

    def held_out_loss() -> float:
        """On every rank (PS lookups are collective): the same 4 held-out batches."""
        with torch.no_grad():
            losses = [negative_sampling_loss(model(*data.batch(k, args.batch_size * size, rank, args.batch_size,
                                                               held_out=True))).item() for k in range(4)]
        return average(float(np.mean(losses)))

    def say(line: str) -> None:  # the newline in the same write: horovodrun tags each chunk it reads
        print(line + "\n", end="", flush=True)

    bar = None
    if rank == 0 and (args.progress or (args.progress is None and sys.stderr.isatty())):
        from tqdm import tqdm

        bar = tqdm(total=args.steps, unit="step", dynamic_ncols=True)
        say = bar.write
    if rank == 0:
        say(f"text: {len(text.train):,} training tokens, vocab {args.vocab:,}, "
            f"{np.count_nonzero(text.counts):,} words seen; {size} rank(s) x batch {args.batch_size}")

    losses, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        centre, words = data.batch(step, args.batch_size * size, rank, args.batch_size)
        if args.slow_ms and rank == size - 1:
            time.sleep(args.slow_ms / 1000)
        optimizer.zero_grad()
        loss = negative_sampling_loss(model(centre, words))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step == 1 and rank == 0 and hvd is not None and not args.horovod:
            hvd.explain()
        if bar is not None:
            bar.update()
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        if step % args.log_every == 0 or step == args.steps:
            mean = average(float(np.mean(losses[-args.log_every:])))
            if rank == 0:
                say(f"step {step:5d}  loss {mean:.4f}")
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    after = held_out_loss()
    if rank == 0:
        rate = args.steps * args.batch_size * size / elapsed
        # Before training every score is 0 (zero output vectors): the loss is (1 + K) log 2.
        say(f"held-out loss after training {after:.4f} (untrained: {(1 + args.negatives) * np.log(2):.4f})")
        say(f"{args.steps} steps on {size} rank(s): {rate:,.0f} pairs/s")
        for line in staleness_lines(optimizer):
            say(line)
    if args.dump:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # collective: tables gathered
        step_losses = torch.tensor(losses)  # each step's loss over the global batch:
        if hvd is not None:
            step_losses = hvd.allreduce(step_losses, name="step_losses")  # the mean of the ranks' means
        if rank == 0:
            torch.save({"params": state, "losses": step_losses}, args.dump)


if __name__ == "__main__":
    main()
