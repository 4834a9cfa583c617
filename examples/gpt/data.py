"""A synthetic character-level corpus built from a fixed seed (no downloads), and batches that
depend only on (split, step, rank, micro-batch): a resumed or replayed run sees the same data.

The text is sentences of made-up words drawn with a Zipf-like law from a fixed lexicon, so a
small model has something to learn (spelling, word boundaries, punctuation) in a few steps.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import torch

SEED = 1337
CORPUS_CHARS = 200_000


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor
    val: torch.Tensor
    chars: str

    @property
    def vocab_size(self) -> int:
        return len(self.chars)


def build_corpus(seed: int = SEED, chars: int = CORPUS_CHARS) -> Corpus:
    """The same text, vocabulary and 90/10 split on every rank and every run."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bdfghklmnprstvz" for v in "aeiou"]
    lexicon = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(400)]
    weights = [1.0 / (i + 1) for i in range(len(lexicon))]
    parts: list[str] = []
    size = 0
    while size < chars:
        words = rng.choices(lexicon, weights, k=rng.randint(3, 12))
        sentence = " ".join(words).capitalize() + rng.choice(".!?") + ("\n" if rng.random() < 0.2 else " ")
        parts.append(sentence)
        size += len(sentence)
    text = "".join(parts)[:chars]
    vocab = "".join(sorted(set(text)))
    index = {ch: i for i, ch in enumerate(vocab)}
    data = torch.tensor([index[ch] for ch in text], dtype=torch.long)
    n = int(0.9 * len(data))
    return Corpus(data[:n], data[n:], vocab)


def get_batch(corpus: Corpus, split: str, step: int, rank: int, micro: int, batch_size: int,
              block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, y, w)``: inputs, next-character targets and per-token loss weights (all 1)."""
    data = corpus.train if split == "train" else corpus.val
    key = f"{SEED}:{split}:{step}:{rank}:{micro}".encode()
    gen = torch.Generator().manual_seed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1)
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=gen)
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y, torch.ones(batch_size, block_size)


def poison(batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same batch with one corrupt record: a token whose loss weight is Inf (say, a weight the
    pipeline computed as 1/0). Its loss is Inf on whichever node computes it: the data's fault."""
    x, y, w = batch
    w = w.clone()
    w[0, 0] = float("inf")
    return x, y, w
