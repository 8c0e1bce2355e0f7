"""Document-length distributions for planning and simulation without real data.

The planner and the step simulator need realistic *length mixes* far more than they need text:
HotSPa's gain comes from how the tokens of a mini-batch split between short and long documents.
Each profile below says what its numbers are based on. They are approximations, not ground truth.

Profiles (lengths in tokens; all lognormal parameters are for the natural log of the length):

``commoncrawl``  most tokens sit in short documents. Lognormal ``mu=6.025, sigma=0.9``
    (median ~413, mean ~620 tokens). The mean follows the falcon-refinedweb dataset card
    (huggingface.co/datasets/tiiuae/falcon-refinedweb): 968,000,015 documents holding
    "500-650GT depending on the tokenizer", i.e. ~520-670 tokens per document. ``sigma`` was
    chosen so that the documents between 512 and 8192 tokens have quartiles 655/873/1297,
    matching the 653/871/1315 (GPT-4 tokenizer) published for the 1M-document sample
    BEE-spoke-data/falcon-refinedweb-1M_en_medium. Under this fit ~5% of tokens are in
    documents longer than 4K. Only the mean and the 512-8192 band were matched; the real
    distribution is not exactly lognormal, so treat this as a CommonCrawl-*like* mix.
``github``       long-tailed, most tokens in long documents. Lognormal ``mu=8.53, sigma=1.88``:
    the maximum-likelihood fit (mean and std of log length, :func:`fit_lognormal`) to the 1,762
    non-empty ``.py`` files of the bundled CPython 3.11.7 standard library, in BYTE tokens.
    Measured corpus: median 6.8K, 97% of tokens in documents over 4K, 79% over 16K. The fit:
    median 5.1K, 98% over 4K, 90% over 16K (a lognormal overstates the far tail: its p99 is
    ~405K where the corpus has 163K). It is code in byte tokens, not starcoderdata in BPE
    tokens: pass ``scale`` (e.g. ``1/3.5``) to approximate a BPE tokenizer; that ratio is a
    rule of thumb, not measured here.
``uniform``      integers uniform on ``[low, high]`` (defaults 1..4096): a neutral baseline.
``bimodal``      a synthetic stress mix, not a measurement: with probability ``long_fraction``
    (0.1) a lognormal around 16K (``long_mu=ln 16384, long_sigma=0.3``), otherwise one around
    512 (``short_mu=ln 512, short_sigma=0.5``).

Every draw is clipped to ``[min_length, max_length]`` after scaling and is a pure function of
``(kind, params, seed, n)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..checks import check_int
from .errors import DataError

LENGTH_PROFILES: dict[str, dict[str, float]] = {
    "commoncrawl": {"mu": 6.025, "sigma": 0.9},
    "github": {"mu": 8.53, "sigma": 1.88},
    "uniform": {"low": 1.0, "high": 4096.0},
    "bimodal": {
        "short_mu": math.log(512),
        "short_sigma": 0.5,
        "long_mu": math.log(16384),
        "long_sigma": 0.3,
        "long_fraction": 0.1,
    },
}


@dataclass(frozen=True, kw_only=True)
class LengthGenerator:
    """Deterministic document lengths (and synthetic token documents) from a named profile."""

    kind: str = "commoncrawl"
    seed: int = 0
    min_length: int = 1
    max_length: int | None = None
    scale: float = 1.0
    params: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_PROFILES:
            raise DataError(
                f"LengthGenerator kind must be one of {sorted(LENGTH_PROFILES)}, got {self.kind!r}"
            )
        unknown = set(self.params) - set(LENGTH_PROFILES[self.kind])
        if unknown:
            raise DataError(
                f"LengthGenerator({self.kind!r}) got unknown params {sorted(unknown)}; "
                f"known: {sorted(LENGTH_PROFILES[self.kind])}"
            )
        check_int(self.seed, "LengthGenerator seed", minimum=0, error=DataError)
        if self.min_length < 1:
            raise DataError(f"LengthGenerator min_length must be >= 1, got {self.min_length}")
        if self.max_length is not None and self.max_length < self.min_length:
            raise DataError(
                f"LengthGenerator max_length={self.max_length} is below min_length={self.min_length}"
            )
        if not self.scale > 0:
            raise DataError(f"LengthGenerator scale must be > 0, got {self.scale}")
        p = self.resolved_params()
        if self.kind == "uniform" and not 1 <= p["low"] <= p["high"]:
            raise DataError(f"uniform needs 1 <= low <= high, got low={p['low']} high={p['high']}")
        if self.kind == "bimodal" and not 0.0 <= p["long_fraction"] <= 1.0:
            raise DataError(f"bimodal long_fraction must be in [0, 1], got {p['long_fraction']}")

    def resolved_params(self) -> dict[str, float]:
        """The profile's defaults with this generator's overrides applied."""
        return {**LENGTH_PROFILES[self.kind], **self.params}

    def fingerprint(self) -> dict[str, Any]:
        """Everything the output depends on (cache keys, logs)."""
        return {
            "kind": self.kind,
            "seed": self.seed,
            "min_length": self.min_length,
            "max_length": self.max_length,
            "scale": self.scale,
            "params": self.resolved_params(),
        }

    def lengths(self, n: int) -> np.ndarray:
        """``n`` document lengths (int64), the same for the same generator and ``n``."""
        if n < 0:
            raise DataError(f"number of documents must be >= 0, got {n}")
        rng = np.random.default_rng([self.seed, 0])
        p = self.resolved_params()
        if self.kind in ("commoncrawl", "github"):
            raw = rng.lognormal(p["mu"], p["sigma"], size=n)
        elif self.kind == "uniform":
            raw = rng.integers(int(p["low"]), int(p["high"]), size=n, endpoint=True).astype(float)
        else:
            long = rng.random(size=n) < p["long_fraction"]
            short_draw = rng.lognormal(p["short_mu"], p["short_sigma"], size=n)
            long_draw = rng.lognormal(p["long_mu"], p["long_sigma"], size=n)
            raw = np.where(long, long_draw, short_draw)
        out = np.rint(raw * self.scale).astype(np.int64)
        hi = self.max_length if self.max_length is not None else np.iinfo(np.int64).max
        return np.clip(out, self.min_length, hi)

    def token_documents(self, n: int, vocab_size: int) -> list[np.ndarray]:
        """``n`` int32 documents of random token ids with :meth:`lengths` as their lengths."""
        if vocab_size < 1:
            raise DataError(f"vocab_size must be >= 1, got {vocab_size}")
        rng = np.random.default_rng([self.seed, 1])
        return [rng.integers(0, vocab_size, size=int(k), dtype=np.int32) for k in self.lengths(n)]


def fit_lognormal(lengths: np.ndarray) -> tuple[float, float]:
    """Maximum-likelihood lognormal ``(mu, sigma)`` of positive lengths (how ``github`` was made)."""
    arr = np.asarray(lengths, dtype=np.float64)
    arr = arr[arr > 0]
    if arr.size == 0:
        raise DataError("fit_lognormal needs at least one positive length")
    logs = np.log(arr)
    return float(logs.mean()), float(logs.std())


def length_summary(lengths: np.ndarray) -> dict[str, float]:
    """Document count, token count and length percentiles, for reports and dry runs."""
    arr = np.asarray(lengths, dtype=np.int64)
    if arr.size == 0:
        return {"documents": 0, "tokens": 0}
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {
        "documents": int(arr.size),
        "tokens": int(arr.sum()),
        "mean": float(arr.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": int(arr.max()),
    }
