"""XLA compilation for every jitted kernel here (`jit` is `jax.jit` with the CPU compiler options below) and
`to_device`, which hands XLA a host array without copying it."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ops.host import aligned

#: XLA's CPU backend (jaxlib 0.10) hands dot, reduce and elementwise fusions to YNNPACK by default. Its reduce
#: over a short minor axis is pathologically slow: sum(x * y, -1) over [169343, 1, 40] takes 70 ms against 2.8 ms
#: from XLA's own emitter, and GAT's step is full of such reductions (each row's softmax term Σ_f g·out, the
#: per-head scores Σ_f z·a, the attention vectors' and biases' gradients), so the default cost the GAT epoch at
#: ogbn-arxiv's size ~1.9-2.0 s against 1.24-1.5 s with dots alone on YNNPACK (`bench/peers.py`; GCN's epoch is
#: unchanged within noise). Keeping each dot its own YNNPACK fusion and leaving reductions and elementwise work
#: to XLA's emitters is `LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT`.
CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


@functools.lru_cache(maxsize=None)
def compiler_options() -> dict | None:
    """`CPU_OPTIONS` if this jaxlib accepts them (an older or newer XLA may not know the option), else None."""
    try:
        jax.jit(lambda v: v + 1, compiler_options=CPU_OPTIONS).lower(jnp.zeros((1,), jnp.float32)).compile()
    except Exception:  # noqa: BLE001 - any rejection means: compile with XLA's defaults
        return None
    return dict(CPU_OPTIONS)


def jit(fun=None, **kwargs):
    """`jax.jit(fun, **kwargs)` with `compiler_options()`; usable as a decorator, bare or with arguments."""
    if fun is None:
        return functools.partial(jit, **kwargs)
    opts = compiler_options()
    if opts:
        kwargs = {**kwargs, "compiler_options": {**opts, **(kwargs.get("compiler_options") or {})}}
    return jax.jit(fun, **kwargs)


def to_device(a) -> jax.Array:
    """A device array of host array `a`; on the CPU backend it is `a`'s memory (copied once into an aligned
    buffer when `a` is not aligned: `ops.host`), so `a` must not be written afterwards."""
    if isinstance(a, jax.Array):
        return a
    return jax.device_put(aligned(a), may_alias=True)
