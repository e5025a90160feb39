"""A small language model with a large vocabulary, trained with hybridsync (sampled softmax).

Bengio et al.'s neural LM on synthetic Zipfian text: the `--context` previous words are looked up
in an input embedding (`--vocab` x `--dim`, default 100,000 x 64), concatenated and passed
through a small MLP to a `--dim` vector h; the next word's logit is <h, w_word> + b_word, with
w and b the rows of an output table (`--vocab` x `--dim`) and a bias table (`--vocab` x 1).

Sampled softmax: a full softmax would read and update every row of the output table at every
step (a dense 100,000 x 64 gradient). Instead each step scores the batch's target words against
`--sampled` words drawn once per step from the log-uniform (Zipf) distribution, shared by the
whole batch, and subtracts log(expected count) from every logit, so that the gradient
approximates the full softmax's (Jean et al. 2015; TensorFlow's sampled_softmax_loss).
So the output and bias tables, like the input embedding, are nn.Embedding(sparse=True) modules
whose gradient touches only the rows of (targets + sampled words): all three tables go to the
parameter server, sharded over the ranks, and only the MLP is all-reduced.

`--tied` shares one table between input embedding and output projection (Press & Wolf 2017):
the model calls the same nn.Embedding module twice per step, once for the context words and
once for the output rows; hybridsync pulls the table's rows twice and pushes both gradients
to the same shards, summed per row, as autograd would sum them in one process. The bias table
stays separate.

Each step draws one global batch from the text and rank r trains on its slice, so N ranks x
`--batch-size` b see what one process with batch N*b sees (`--plain-torch` runs that process
without hybridsync: the tests compare the two). At the end, rank 0 prints the held-out
perplexity under the *full* softmax next to the unigram perplexity the model has to beat.

    mpirun -np 2 python examples/torch_lm.py                  # as root: mpirun --allow-run-as-root
    mpirun -np 2 python examples/torch_lm.py --tied --steps 2000
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from zipf_text import ZipfText


class NeuralLM(nn.Module):
    def __init__(self, vocab: int, dim: int, context: int, hidden: int, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, sparse=True)
        self.mlp = nn.Sequential(nn.Linear(context * dim, hidden), nn.Tanh(), nn.Linear(hidden, dim))
        # Tied: the same module (one parameter, one PS table) is the output projection.
        self.out = self.embed if tied else nn.Embedding(vocab, dim, sparse=True)
        self.bias = nn.Embedding(vocab, 1, sparse=True)
        nn.init.normal_(self.embed.weight, std=0.1)
        if not tied:
            nn.init.normal_(self.out.weight, std=0.1)
        nn.init.zeros_(self.bias.weight)

    def hidden(self, context):
        """context: (B, C) ids of the previous words -> (B, dim)."""
        return self.mlp(self.embed(context).flatten(1))

    def forward(self, context, candidates):
        """candidates: the B target words, then the S sampled words. Returns the targets' logits
        (B,) and every context's logits for the sampled words (B, S), uncorrected."""
        h = self.hidden(context)
        w, b = self.out(candidates), self.bias(candidates).squeeze(1)
        batch = context.shape[0]
        true_logits = (h * w[:batch]).sum(1) + b[:batch]
        sampled_logits = h @ w[batch:].T + b[batch:]
        return true_logits, sampled_logits


class LogUniformSampler:
    """Draws word ids with q(k) = log((k + 2) / (k + 1)) / log(V + 1): Zipf's law for ids that
    are frequency ranks (TensorFlow's log_uniform_candidate_sampler), with replacement."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        ids = np.floor(np.exp(rng.random(n) * math.log(self.vocab + 1))).astype(np.int64) - 1
        return np.clip(ids, 0, self.vocab - 1)

    def log_expected_count(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        k = ids.to(torch.float64)
        q = torch.log((k + 2) / (k + 1)) / math.log(self.vocab + 1)
        return torch.log(n * q).to(torch.float32)


def sampled_softmax_loss(true_logits, sampled_logits, targets, sampled, sampler: LogUniformSampler):
    """Cross-entropy of the target against the sampled words, logits corrected by log Q; a
    sampled word equal to the target ("accidental hit") is removed from that row."""
    n = sampled.shape[0]
    true_logits = true_logits - sampler.log_expected_count(targets, n)
    sampled_logits = sampled_logits - sampler.log_expected_count(sampled, n)
    sampled_logits = sampled_logits.masked_fill(targets[:, None] == sampled[None, :], float("-inf"))
    logits = torch.cat([true_logits[:, None], sampled_logits], dim=1)
    return F.cross_entropy(logits, torch.zeros(len(targets), dtype=torch.long))


class LMBatches:
    """Step s's global batch (positions and sampled words) depends only on (seed, s): every rank
    draws the same one and keeps its slice, whatever the number of ranks."""

    def __init__(self, text: ZipfText, context: int, sampled: int, seed: int):
        self.text, self.context, self.sampled, self.seed = text, context, sampled, seed
        self.sampler = LogUniformSampler(text.vocab)

    def batch(self, step: int, global_batch: int, rank: int, local_batch: int):
        rng = np.random.default_rng([self.seed, step])
        tokens = self.text.train
        at = rng.integers(self.context, len(tokens), global_batch)[rank * local_batch:(rank + 1) * local_batch]
        context = tokens[at[:, None] + np.arange(-self.context, 0)]
        targets, sampled = tokens[at], self.sampler.sample(rng, self.sampled)
        return torch.from_numpy(context), torch.from_numpy(targets), torch.from_numpy(sampled)


def held_out_perplexity(model: NeuralLM, text: ZipfText, context: int, positions: int = 1024) -> float:
    """Full-softmax perplexity of the first `positions` held-out next words. Reads the whole
    output and bias tables (a collective pull on the PS: call it on every rank)."""
    with torch.no_grad():
        everyone = torch.arange(text.vocab)
        w, b = model.out(everyone), model.bias(everyone).squeeze(1)
        at = np.arange(context, min(len(text.test), context + positions))
        ctx = torch.from_numpy(text.test[at[:, None] + np.arange(-context, 0)])
        targets = torch.from_numpy(text.test[at])
        nll = 0.0
        for i in range(0, len(at), 128):
            logits = model.hidden(ctx[i:i + 128]) @ w.T + b
            nll += F.cross_entropy(logits, targets[i:i + 128], reduction="sum").item()
    return math.exp(nll / len(at))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=256, help="next-word predictions per rank")
    parser.add_argument("--vocab", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--context", type=int, default=4, help="previous words the model reads")
    parser.add_argument("--sampled", type=int, default=1024, help="sampled words per step (shared by the batch)")
    parser.add_argument("--tokens", type=int, default=2_000_000, help="length of the synthetic text")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of word frequencies")
    parser.add_argument("--tied", action="store_true", help="input embedding and output projection share one table")
    parser.add_argument("--optimizer", choices=["adagrad", "sgd"], default="adagrad")
    parser.add_argument("--lr", type=float, default=None, help="default: 0.1 for adagrad, 1.0 for sgd")
    parser.add_argument("--placement", choices=["sharded", "replicated"], default="sharded")
    parser.add_argument("--config", default=None, help="YAML config with per-variable overrides")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plain-torch", action="store_true",
                        help="train in this one process with plain torch, no hybridsync: the reference "
                             "that N ranks x --batch-size b must match with --batch-size N*b")
    parser.add_argument("--dump", metavar="PATH", default=None,
                        help="save the final parameters and the per-step losses here (torch.save)")
    parser.add_argument("--eval", action=argparse.BooleanOptionalAction, default=True,
                        help="full-softmax held-out perplexity after training")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="tqdm progress bar on rank 0 (default: when stderr is a terminal; under mpirun "
                             "it is a pipe)")
    args = parser.parse_args()
    lr = args.lr if args.lr is not None else {"adagrad": 0.1, "sgd": 1.0}[args.optimizer]

    torch.set_num_threads(1)
    if args.plain_torch:
        hvd, rank, size = None, 0, 1
    else:
        import hybridsync.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(args.seed)
    text = ZipfText(args.vocab, args.tokens, args.zipf, seed=args.seed)
    data = LMBatches(text, args.context, args.sampled, args.seed)
    model = NeuralLM(args.vocab, args.dim, args.context, args.hidden, args.tied)
    optimizer = (torch.optim.Adagrad if args.optimizer == "adagrad" else torch.optim.SGD)(model.parameters(), lr=lr)
    if hvd is not None:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # model=model: the tables are sharded on the parameter server (each rank holds 1/N);
        # without it (--placement replicated) every rank keeps a replica, as with Horovod.
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             model=model if args.placement == "sharded" else None,
                                             config=args.config)

    def average(value):
        return value if hvd is None else hvd.allreduce(torch.as_tensor(value), name="loss")

    def say(line: str) -> None:  # the newline in the same write: horovodrun tags each chunk it reads
        print(line + "\n", end="", flush=True)

    bar = None
    if rank == 0 and (args.progress or (args.progress is None and sys.stderr.isatty())):
        from tqdm import tqdm

        bar = tqdm(total=args.steps, unit="step", dynamic_ncols=True)
        say = bar.write
    if rank == 0:
        say(f"text: {len(text.train):,} training tokens, vocab {args.vocab:,}, "
            f"{np.count_nonzero(text.counts):,} words seen; {'tied' if args.tied else 'untied'} output table; "
            f"{size} rank(s) x batch {args.batch_size}, {args.sampled} sampled words per step")

    losses, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        context, targets, sampled = data.batch(step, args.batch_size * size, rank, args.batch_size)
        optimizer.zero_grad()
        true_logits, sampled_logits = model(context, torch.cat([targets, sampled]))
        loss = sampled_softmax_loss(true_logits, sampled_logits, targets, sampled, data.sampler)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step == 1 and rank == 0 and hvd is not None:
            hvd.explain()
        if bar is not None:
            bar.update()
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        if step % args.log_every == 0 or step == args.steps:
            mean = float(average(float(np.mean(losses[-args.log_every:]))))
            if rank == 0:
                say(f"step {step:5d}  loss {mean:.4f}")
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    if rank == 0:
        say(f"{args.steps} steps on {size} rank(s): {args.steps * args.batch_size * size / elapsed:,.0f} words/s")
    if args.eval:
        after = held_out_perplexity(model, text, args.context)
        if rank == 0:
            say(f"held-out perplexity after training {after:,.1f} (full softmax; a unigram model: "
                f"{text.unigram_perplexity():,.1f}, an untrained one: about {args.vocab:,})")
    if args.dump:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # collective: tables gathered
        step_losses = average(torch.tensor(losses))  # each step's loss over the global batch
        if rank == 0:
            torch.save({"params": state, "losses": step_losses}, args.dump)


if __name__ == "__main__":
    main()
