"""Feature room: structural node features for graphs that come without any, and the feature normalization."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import scipy.sparse as sp

from pipelines.config import FEATURE_NORMS
from pipelines.data.graph import row_normalize

DEGREE_BINS = 16


def degree_features(adj: sp.spmatrix, bins: int = DEGREE_BINS) -> np.ndarray:
    """float32 [N, bins + 1]: a constant 1 column plus a one-hot of the log2 degree bucket.

    Identity (one-hot node id) features would be N x N dense, unusable beyond toy graphs, and tie the model
    to node ids; degree buckets cost O(N), work at any size and carry the one signal every graph has.
    Bucket k holds degrees in [2^k - 1, 2^(k+1) - 1); the last bucket takes everything larger.
    """
    deg = np.asarray(adj.getnnz(axis=1)).ravel()
    bucket = np.minimum(np.floor(np.log2(deg + 1.0)).astype(np.int64), bins - 1)
    out = np.zeros((deg.size, bins + 1), dtype=np.float32)
    out[:, 0] = 1.0
    out[np.arange(deg.size), 1 + bucket] = 1.0
    return out


def resolve_feature_norm(features: np.ndarray, mode: str = "auto") -> str:
    """The normalization `mode` means for these features: "row" or "none" ("auto" decides from the features).

    Row normalization (Kipf's preprocessing) turns a row with k non-zeros into entries of about 1/k, and the
    first layer's data gradient shrinks with them while the L2 gradient wd·W0 (W0 ~ 1/sqrt(F) at Glorot
    init) does not: their ratio goes as sqrt(F)/k. Under Adam an entry whose L2 gradient dominates is pulled
    to zero at the full learning rate, so with long rows (k > sqrt(F): Amazon's 267 words of 767) the first
    layer is decayed instead of learned. "auto" row-normalizes while the mean row has at most sqrt(F)
    non-zeros (Planetoid, Coauthor, Cora-ML: ratio >= 1) and keeps the features as they are otherwise,
    as it does for features with negative entries (their row sums can be near zero).
    """
    if mode not in FEATURE_NORMS:
        raise ValueError(f"feature_norm must be one of {', '.join(FEATURE_NORMS)}, got {mode!r}")
    if mode != "auto":
        return mode
    return norm_from_stats(FeatureStats.of(features))


class FeatureStats(NamedTuple):
    """What "auto" decides from, summable over blocks of rows (a prepared graph's shards)."""

    dim: int
    min_value: float       # +inf for no rows
    nnz: int               # non-zeros over the non-empty rows
    nonempty_rows: int

    @classmethod
    def of(cls, features: np.ndarray) -> "FeatureStats":
        rows, dim = features.shape
        if rows == 0 or dim == 0:
            return cls(dim, float("inf"), 0, 0)
        nnz = np.count_nonzero(features, axis=1)
        return cls(dim, float(features.min()), int(nnz.sum()), int((nnz > 0).sum()))

    def __add__(self, other: "FeatureStats") -> "FeatureStats":
        return FeatureStats(self.dim, min(self.min_value, other.min_value), self.nnz + other.nnz,
                            self.nonempty_rows + other.nonempty_rows)


def norm_from_stats(stats: FeatureStats) -> str:
    """"row" while the mean non-empty row has at most sqrt(F) non-zeros and no entry is negative, else "none"."""
    if stats.dim == 0 or stats.nonempty_rows == 0 or stats.min_value < 0:
        return "none"
    return "row" if stats.nnz / stats.nonempty_rows <= np.sqrt(stats.dim) else "none"


def normalize_features(features: np.ndarray, mode: str = "auto") -> np.ndarray:
    """Features after the normalization `mode` resolves to for them (see `resolve_feature_norm`)."""
    return row_normalize(features) if resolve_feature_norm(features, mode) == "row" else features
