"""Default-feature room: structural node features for graphs that come without any."""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp

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
