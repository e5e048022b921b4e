"""The optimizer the parameter server applies (WU): optax Adam with masked L2 weight decay."""
from __future__ import annotations

import functools

import numpy as np
import optax


def l2_decay(weight_decay: float, decay_mask) -> optax.GradientTransformation:
    """Gradient of weight_decay · Σ W² / 2 over the masked weights, added to the loss gradient (Kipf's L2)."""
    return optax.add_decayed_weights(weight_decay, mask=decay_mask)


def make_optimizer(lr: float, weight_decay: float, decay_mask) -> optax.GradientTransformation:
    """Adam (Kingma & Ba, 2015) on gradients plus weight_decay · W for the masked weights (L2, as in Kipf's GCN).

    The same settings give the same (stateless) object, so a program jitted over it (the parameter server's WU)
    compiles once per process, not once per continuous-training round that builds its optimizer again."""
    if isinstance(decay_mask, dict) and all(isinstance(v, dict) for v in decay_mask.values()):
        frozen = tuple(sorted((k, tuple(sorted(v.items()))) for k, v in decay_mask.items()))
        return _optimizer(float(lr), float(weight_decay), frozen)
    return optax.chain(l2_decay(weight_decay, decay_mask), optax.adam(lr))


@functools.lru_cache(maxsize=64)
def _optimizer(lr: float, weight_decay: float, frozen_mask: tuple) -> optax.GradientTransformation:
    mask = {k: dict(v) for k, v in frozen_mask}
    return optax.chain(l2_decay(weight_decay, mask), optax.adam(lr))


def dropout_seeds(seed: int, epoch: int, num_stages: int) -> np.ndarray:
    """One uint32 dropout seed per stage for an epoch; a function of (seed, epoch) alone, so every engine agrees."""
    return np.random.default_rng([int(seed), int(epoch), 0x0D0]).integers(0, 2**32, num_stages, dtype=np.uint32)
