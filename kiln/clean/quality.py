"""Corpus-trained quality signals: a hashed n-gram logistic-regression classifier (reference-quality text against
random web text from the same corpus, as Llama 3 and DCLM do with larger models) and a token-distribution outlier
score (KL divergence of a document's word distribution from the corpus's, as in Llama 3).

Used by kiln.clean.corpus; train one by hand with ``train_classifier(pos_texts, neg_texts, QualityModelConfig())``.
"""

from __future__ import annotations

import math
import re
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Annotated, Any, Iterable

import numpy as np

from kiln.common.config import ConfigError, Domain, check_types

_TOKEN = re.compile(r"\w+|[^\w\s]")


@dataclass
class QualityModelConfig:
    enabled: bool = True  # train the classifier and drop documents it scores below min_score
    reference_sources: list[str] = field(default_factory=lambda: ["wikipedia"])  # globs of reference-quality sources
    min_score: Annotated[float, Domain(0, 1)] = 0.02  # probability of "reference-like" below this drops the document
    buckets: Annotated[int, Domain(1)] = 1 << 18  # hashed feature buckets (unigrams and bigrams of lower-cased tokens)
    max_tokens: Annotated[int, Domain(1)] = 1000  # tokens read per document (the opening is enough and keeps training fast)
    max_train_docs: Annotated[int, Domain(1)] = 4000  # documents per class sampled for training (reservoir sample, fixed seed)
    epochs: Annotated[int, Domain(1)] = 8  # passes over the training set
    lr: Annotated[float, Domain(0, low_open=True)] = 0.2  # Adam learning rate
    weight_decay: Annotated[float, Domain(0)] = 1e-6  # L2 penalty (as AdamW decay) on the bucket weights
    val_fraction: Annotated[float, Domain(0, 1, high_open=True)] = 0.2  # share of the sample held out to report accuracy
    seed: Annotated[int, Domain(0)] = 0  # sampling and initialisation seed

    def __post_init__(self) -> None:
        check_types(self, "clean.quality_model")
        if not 0.0 <= self.min_score < 1.0:
            raise ConfigError(f"clean.quality_model.min_score must be in [0, 1), got {self.min_score}.")
        if self.buckets < 2 or self.max_train_docs < 4 or self.epochs < 1:
            raise ConfigError("clean.quality_model: buckets >= 2, max_train_docs >= 4 and epochs >= 1 are required.")


def features(text: str, buckets: int, max_tokens: int) -> np.ndarray:
    """(n_features,) int64 bucket ids of the text's unigrams and bigrams (crc32: stable across processes)."""
    toks = _TOKEN.findall(text[: max_tokens * 12].lower())[:max_tokens]
    grams = toks + [a + " " + b for a, b in zip(toks, toks[1:])]
    if not grams:
        grams = [""]
    return np.fromiter((zlib.crc32(g.encode()) % buckets for g in grams), dtype=np.int64, count=len(grams))


class HashedNgramClassifier:
    """Logistic regression on the mean of hashed n-gram weights: score = sigmoid(mean_j w[f_j] + b)."""

    def __init__(self, buckets: int, max_tokens: int, seed: int = 0) -> None:
        import torch

        torch.manual_seed(seed)
        self.buckets, self.max_tokens = buckets, max_tokens
        self.bag = torch.nn.EmbeddingBag(buckets, 1, mode="mean")
        torch.nn.init.zeros_(self.bag.weight)
        self.bias = torch.nn.Parameter(torch.zeros(1))

    def parameters(self) -> list[Any]:
        return [self.bag.weight, self.bias]

    def _batch(self, feats: list[np.ndarray]):
        import torch

        offsets = np.cumsum([0] + [len(f) for f in feats[:-1]])
        return torch.from_numpy(np.concatenate(feats)), torch.from_numpy(offsets)

    def logits(self, feats: list[np.ndarray]):
        flat, offsets = self._batch(feats)  # (sum n_j,), (B,)
        return self.bag(flat, offsets).squeeze(1) + self.bias  # (B,)

    def score(self, texts: list[str]) -> np.ndarray:
        """(len(texts),) probability that each text is reference-like."""
        import torch

        if not texts:
            return np.zeros(0)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.no_grad():
                feats = [features(t, self.buckets, self.max_tokens) for t in texts]
                return torch.sigmoid(self.logits(feats)).numpy().astype(np.float64)
        finally:
            torch.set_num_threads(threads)

    def state_dict(self) -> dict[str, Any]:
        return {"weight": self.bag.weight.detach().clone(), "bias": self.bias.detach().clone(),
                "buckets": self.buckets, "max_tokens": self.max_tokens}


def train_classifier(pos: list[str], neg: list[str], cfg: QualityModelConfig) -> tuple[HashedNgramClassifier, dict]:
    """Train on ``pos`` (label 1) against ``neg`` (label 0); returns the model and its held-out metrics."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny dense updates: extra threads only add contention (12x slower on 2 busy cores)
    try:
        return _train(pos, neg, cfg)
    finally:
        torch.set_num_threads(threads)


def _train(pos: list[str], neg: list[str], cfg: QualityModelConfig) -> tuple[HashedNgramClassifier, dict]:
    import torch

    rng = np.random.default_rng(cfg.seed)
    texts = pos + neg
    labels = np.array([1.0] * len(pos) + [0.0] * len(neg), dtype=np.float32)
    order = rng.permutation(len(texts))
    n_val = int(len(texts) * cfg.val_fraction) if len(texts) >= 10 else 0
    val, train = order[:n_val], order[n_val:]
    feats = [features(t, cfg.buckets, cfg.max_tokens) for t in texts]
    model = HashedNgramClassifier(cfg.buckets, cfg.max_tokens, cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    y = torch.from_numpy(labels)
    batch = 64
    for _ in range(cfg.epochs):
        perm = rng.permutation(train)
        for i in range(0, len(perm), batch):
            idx = perm[i : i + batch]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model.logits([feats[j] for j in idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    metrics: dict[str, Any] = {"train_docs": len(train), "val_docs": n_val, "positives": len(pos), "negatives": len(neg)}
    with torch.no_grad():
        for name, idx in (("train", train), ("val", val)):
            if len(idx):
                p = torch.sigmoid(model.logits([feats[j] for j in idx])).numpy()
                metrics[f"{name}_accuracy"] = round(float(((p > 0.5) == (labels[idx] > 0.5)).mean()), 4)
    return model, metrics


class Reservoir:
    """A fixed-size uniform sample of a stream (Algorithm R), seeded."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seen, self.items = size, 0, []
        self.rng = np.random.default_rng(seed)

    def add(self, item: Any) -> None:
        self.seen += 1
        if len(self.items) < self.size:
            self.items.append(item)
        else:
            j = int(self.rng.integers(0, self.seen))
            if j < self.size:
                self.items[j] = item


# ---------------------------------------------------------------------------------------------- token outliers


@dataclass
class TokenOutlierConfig:
    """Documents whose word distribution is far from the corpus's (Llama 3's token-distribution KL rule)."""

    enabled: bool = True  # score every document and drop the outliers
    max_mad: Annotated[float, Domain(0, low_open=True)] = 8.0  # drop when KL is more than this many median absolute deviations above the corpus median
    vocab_size: Annotated[int, Domain(1)] = 50_000  # the corpus's most frequent words kept as the reference distribution; the rest pool
    max_words: Annotated[int, Domain(1)] = 2000  # words of a document read for its distribution
    min_docs: Annotated[int, Domain(1)] = 50  # fewer documents than this: no corpus distribution to speak of, the rule is skipped

    def __post_init__(self) -> None:
        check_types(self, "clean.token_outliers")


_WORD = re.compile(r"\w+")


def doc_words(text: str, max_words: int) -> list[str]:
    return _WORD.findall(text[: max_words * 12].lower())[:max_words]


class TokenDistribution:
    """Corpus word counts (``add``), then ``kl(text)``: KL(document || corpus) in nats, add-one smoothed corpus."""

    OTHER = "\x00other"

    def __init__(self, cfg: TokenOutlierConfig) -> None:
        self.cfg = cfg
        self.counts: Counter[str] = Counter()
        self.logq: dict[str, float] = {}

    def add(self, text: str) -> None:
        self.counts.update(doc_words(text, self.cfg.max_words))

    def freeze(self) -> None:
        top = self.counts.most_common(self.cfg.vocab_size)
        rest = sum(self.counts.values()) - sum(c for _, c in top)
        total = sum(c for _, c in top) + rest + len(top) + 1
        self.logq = {w: math.log((c + 1) / total) for w, c in top}
        self.logq[self.OTHER] = math.log((rest + 1) / total)
        self.counts = Counter()

    def kl(self, text: str) -> float:
        words = doc_words(text, self.cfg.max_words)
        if not words:
            return 0.0
        other = self.OTHER
        p = Counter(w if w in self.logq else other for w in words)
        n = len(words)
        return sum((c / n) * (math.log(c / n) - self.logq[w]) for w, c in p.items())


def mad_limit(values: Iterable[float], max_mad: float) -> tuple[float, float, float]:
    """(median, MAD, limit = median + max_mad * MAD) of the values (robust to the outliers themselves)."""
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        return 0.0, 0.0, math.inf
    med = float(np.median(arr))
    mad = float(np.median(np.abs(arr - med)))
    return med, mad, med + max_mad * mad if mad > 0 else math.inf
