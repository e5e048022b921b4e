"""Host arrays XLA's CPU backend can use in place: 64-byte aligned numpy buffers (numpy only, no jax)."""
from __future__ import annotations

import numpy as np

#: XLA's CPU client uses a host buffer in place (no copy) only when it starts on a 64-byte boundary. numpy's
#: large arrays come from malloc's mmap chunks, which start 16 bytes into a page, so `device_put` of any of
#: them (and a jitted call given one) copies it: at R-MAT 2^20 the graph servers' whole-partition blocks, the
#: evaluation graph and each epoch's column views were all held twice.
ALIGNMENT = 64


def host_empty(shape, dtype=np.float32) -> np.ndarray:
    """An uninitialized C-contiguous host array starting on an `ALIGNMENT` boundary."""
    return _aligned_view(np.empty, shape, dtype)


def host_zeros(shape, dtype=np.float32) -> np.ndarray:
    """`host_empty`, zeroed: from calloc like `np.zeros`, so pages never written (padding) take no memory."""
    return _aligned_view(np.zeros, shape, dtype)


def _aligned_view(alloc, shape, dtype) -> np.ndarray:
    shape = (shape,) if np.isscalar(shape) else tuple(int(s) for s in shape)
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = alloc(nbytes + ALIGNMENT, np.uint8)
    off = (-buf.ctypes.data) % ALIGNMENT
    return buf[off: off + nbytes].view(dtype).reshape(shape)


def aligned(a, dtype=None) -> np.ndarray:
    """`a` as a C-contiguous host array of `dtype` on an `ALIGNMENT` boundary: `a` itself when it already is one,
    else a copy."""
    a = np.asarray(a, dtype)
    if a.flags.c_contiguous and a.ctypes.data % ALIGNMENT == 0:
        return a
    out = host_empty(a.shape, a.dtype)
    out[...] = a
    return out

