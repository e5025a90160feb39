"""Synthetic Zipfian text for the NLP examples: seeded, generated in memory, no downloads.

Word ids are frequency ranks, as in a vocabulary sorted by count: id k is drawn with
probability proportional to (k + 1) ** -exponent (Zipf's law; natural text is close to 1.1).
Each word has a few fixed "followers"; the next token is one of the previous token's followers
with probability `follow`, otherwise a fresh Zipf draw. The text therefore has natural text's
long tail (most of a 100k vocabulary is rare) and a co-occurrence structure to learn: skip-gram
finds it in its windows, a language model in the next token.

Used by torch_word2vec.py and torch_lm.py (python puts this directory on sys.path when either
runs as a script).
"""
from __future__ import annotations

import numpy as np


def zipf_probabilities(vocab: int, exponent: float) -> np.ndarray:
    p = np.arange(1, vocab + 1, dtype=np.float64) ** -exponent
    return p / p.sum()


def sample(cdf: np.ndarray, rng: np.random.Generator, shape) -> np.ndarray:
    """Ids drawn from the distribution whose cumulative sums are `cdf` (inverse transform)."""
    return np.minimum(np.searchsorted(cdf, rng.random(shape) * cdf[-1], side="right"), len(cdf) - 1)


class ZipfText:
    """`tokens` word ids over `vocab` words. The last `held_out` fraction is kept for evaluation;
    `train` and `test` are the two parts, `counts` the training part's word counts."""

    def __init__(self, vocab: int, tokens: int, exponent: float = 1.1, followers: int = 4,
                 follow: float = 0.6, held_out: float = 0.05, seed: int = 0, streams: int = 512):
        rng = np.random.default_rng([seed, 7])
        self.vocab = vocab
        cdf = np.cumsum(zipf_probabilities(vocab, exponent))
        self.followers = sample(cdf, rng, (vocab, followers))
        # `streams` independent texts generated side by side (one NumPy op per position), then
        # laid end to end.
        length = -(-tokens // streams)
        text = np.empty((streams, length), np.int64)
        text[:, 0] = sample(cdf, rng, streams)
        for t in range(1, length):
            nxt = self.followers[text[:, t - 1], rng.integers(0, followers, streams)]
            text[:, t] = np.where(rng.random(streams) < follow, nxt, sample(cdf, rng, streams))
        text = text.reshape(-1)[:tokens]
        split = int(len(text) * (1.0 - held_out))
        self.train, self.test = text[:split], text[split:]
        self.counts = np.bincount(self.train, minlength=vocab)

    def unigram_perplexity(self) -> float:
        """Perplexity of the held-out text under the training unigram (add-one smoothed): what a
        model that ignores context achieves; a language model must beat it."""
        p = (self.counts + 1.0) / (self.counts.sum() + self.vocab)
        return float(np.exp(-np.log(p[self.test]).mean()))
