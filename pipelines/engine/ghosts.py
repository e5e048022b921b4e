"""Ghost-value staleness on a graph server: which ghost rows an epoch reads on its cut edges, by StalenessMode.

A task of epoch e reads the ghost rows of epoch e_ghost = max(e - S, start) (the watermark guarantees they are
there). PLAIN reads them as sent; PREDICT extrapolates them linearly from epochs e_ghost - 1 and e_ghost to e;
SMOOTH and SMOOTH_ZERO read an exponential moving average of them over epochs <= e_ghost (PipeGCN-GF). Each
derived value is computed once, from fixed epochs, in epoch order: runs stay deterministic under any timing.
"""
from __future__ import annotations

import collections
import types

import numpy as np

from ops import models
from pipelines.engine.messages import EngineError
from schemas.tasks import StageKind, StalenessMode

#: γ of the ghost-value average in StalenessMode.SMOOTH. PipeGCN-GF uses 0.95; 0.98 measured better at S=2 on a
#: 50,000-vertex planted graph at P=4 x 8 (0.8975 against 0.891; S=1 0.901 and 0.902; synchronous 0.909). Lower γ,
#: a progress-tied γ and trend-corrected smoothing (Holt, Brown) lag less but damp less: README, 'Bounded staleness'
GHOST_EMA = 0.98
#: the modes whose backward waits for this epoch's ghost gradients: stale ones, even smoothed, apply part of every
#: gradient S epochs late, and full-batch Adam oscillates on delayed gradients (README)
FRESH_GHOST_GRADS = frozenset({StalenessMode.SMOOTH, StalenessMode.SMOOTH_ZERO, StalenessMode.PREDICT})
#: the modes that read the ghost values of an input transform (`input_transforms`) of epoch e, whatever S: any
#: estimate of them from older epochs cost 1.5 points where an average of the last layer's cost none (README)
FRESH_INPUT_TRANSFORMS = FRESH_GHOST_GRADS


def input_transforms(stages) -> frozenset[int]:
    """The AV stages whose outputs are a function of the input features and this epoch's weights alone (a
    transform before the first GA: GCN's first layer in the AV-first order, GAT's first projection).

    Their ghost values are cheap to keep fresh: the producers compute them first thing in the epoch, all from
    the same weight version, so the wait for them is the spread of one AV task across partitions. Stale, they
    carry the old weights and dropout masks of the first layer through every later one: on
    `synthetic:planted?nodes=20000&classes=8&degree=12&features=32` (GCN hidden 16, P=4, S=1, 5 seeds) every
    estimate of them lost 1.1-1.6 points (the γ 0.98 average, γ 0.9, plain e - S), while fresh first-layer
    ghosts with the averaged last layer were 0.2 points above synchronous (README, 'Bounded staleness')."""
    prod = models.producers(types.SimpleNamespace(stages=tuple(stages)))
    out: set[int] = set()
    for st in stages:
        if st.kind == StageKind.AV and all(p == -1 or p in out for p in prod[st.index].values()):
            out.add(st.index)
    return frozenset(out)


def ghost_epoch(e: int, bound: int, start_epoch: int, producer: int, fresh: frozenset) -> int:
    """The epoch of the ghost values of stage `producer` that a task of epoch e reads under staleness bound
    `bound`: e for the `fresh` producers (`input_transforms` in `FRESH_INPUT_TRANSFORMS` modes), else e - bound
    (no earlier than the start)."""
    return e if producer in fresh else max(e - bound, start_epoch)


class GhostReader:
    """The ghost rows [n_own, n_cols) of each stage store that an epoch reads; keeps the derived ones it made."""

    def __init__(self, mode: StalenessMode, start_epoch: int, n_own: int, n_cols: int):
        self.mode, self.start_epoch, self.n_own, self.n_cols = mode, start_epoch, n_own, n_cols
        self.pred = collections.defaultdict(dict)  # key -> e -> ghost rows extrapolated to epoch e
        self.ema = collections.defaultdict(dict)   # key -> e_ghost -> (sum, weight, EMA of ghost rows)
        # averages of dropped epochs, written over again: a fresh array of ghost rows per epoch was faulted in
        # and zeroed by the kernel page by page (16 MB per partition and epoch at ogbn-arxiv's size, P=4)
        self._spare = collections.defaultdict(list)

    def read(self, key, store: dict, e: int, e_ghost: int) -> np.ndarray:
        """The ghost rows epoch e reads from `store` (epoch -> [n_cols, ...] rows of one stage output `key`)."""
        if self.mode in (StalenessMode.SMOOTH, StalenessMode.SMOOTH_ZERO):
            return self._average(key, store, e_ghost)
        if self.mode is not StalenessMode.PREDICT or e_ghost - 1 < self.start_epoch:
            return store[e_ghost][self.n_own:self.n_cols]
        pred = self.pred[key]
        if e not in pred:  # once per epoch, from two fixed versions: deterministic
            new, old = store[e_ghost][self.n_own:self.n_cols], store[e_ghost - 1][self.n_own:self.n_cols]
            pred[e] = new + (e - e_ghost) * (new - old)
        return pred[e]

    def observe(self, key, store: dict, e: int) -> None:
        """Epoch e read its own ghost rows (a synchronous warm-up epoch): fold them into the ghost average, so
        the stale epochs after the warm-up read an average over every epoch, as if it had been read all along."""
        if self.mode in (StalenessMode.SMOOTH, StalenessMode.SMOOTH_ZERO):
            self._average(key, store, e)

    def _average(self, key, store: dict, e_ghost: int) -> np.ndarray:
        """PipeGCN-GF's smoothing (Wan et al., ICLR 2022): m(t) = γ m(t-1) + (1-γ) v(t) over the ghost rows v(t)
        of epochs t <= e_ghost, bias-corrected as Adam's moments are (the first epochs get a plain average, not
        the random-init values). A stale ghost value fed back as is, or extrapolated, carries its layer's old
        weights and its epoch's dropout noise into every cut edge; with fresh weights that delayed, noisy
        feedback makes full-batch Adam oscillate (README, 'Bounded staleness'). The average varies slowly, so
        it feeds back little: on a 2,000-vertex planted graph at P=4 x 1, S=1 0.907 and S=2 0.905 against
        0.901 synchronous (predict 0.849 and 0.737). SMOOTH_ZERO starts m from 0 without the correction (as
        PipeGCN-GF writes it): every epoch's values enter with weight 1-γ from the first, and cut edges fade in
        with weight 1 - γ^t, which costs a slowly training model (README). Once per e_ghost, in epoch order:
        deterministic."""
        ema = self.ema[key]
        if e_ghost in ema:
            return ema[e_ghost][2]
        v = store[e_ghost][self.n_own:self.n_cols]
        if e_ghost == self.start_epoch:
            s, w = v.copy(), 1.0
        elif ema.get(e_ghost - 1, (None,))[0] is not None:
            s0, w0, m0 = ema[e_ghost - 1]
            # s0 is read once, to build this sum: updated in place (γ·s0 + v), its epoch keeps its average
            ema[e_ghost - 1] = (None, w0, m0)
            s, w = np.multiply(s0, GHOST_EMA, out=s0), GHOST_EMA * w0 + 1.0
            s += v
        else:
            raise EngineError(f"ghost average of stage {key[0]} {key[1]}: epoch {e_ghost - 1} was never read")
        # s = Σ γ^(t-j) v(j) and w = Σ γ^(t-j): the bias-corrected average is s / w, m from 0 is (1-γ) s
        spare = self._spare[key]
        m = spare.pop() if spare and spare[-1].shape == s.shape else np.empty_like(s)
        if self.mode is StalenessMode.SMOOTH_ZERO:
            np.multiply(s, 1.0 - GHOST_EMA, out=m)
        else:
            np.divide(s, w, out=m)
        ema[e_ghost] = (s, w, m)
        return m

    def drop_below(self, epoch: int) -> None:
        """Forget the derived rows of epochs below `epoch` (no task reads them any more)."""
        for stores in (self.pred, self.ema):
            for key, st in stores.items():
                for e in [e for e in st if e < epoch]:
                    entry = st.pop(e)
                    if stores is self.ema:
                        self._spare[key][:] = [entry[2]]  # no reader holds it: each copies what it reads
