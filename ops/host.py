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



#: glibc's malloc serves any request above its largest mmap threshold (32 MB) with a fresh mmap and unmaps it at
#: free. XLA's CPU backend allocates each jitted call's outputs and its temporaries that way, so on a graph of more
#: than about 2^19 vertices every epoch faulted in and zeroed those buffers again in 4 KB pages (123,000 faults and
#: 503 MB per epoch at R-MAT 2^22), and the gathers' random row reads over 4 KB pages missed the TLB: seconds per
#: edge grew 1.8x with the graph. This tunable makes malloc ask for transparent huge pages on those chunks
#: (madvise), which the kernel's default THP mode ("madvise") otherwise leaves at 4 KB. glibc reads tunables only
#: when a process starts, so an entry point re-executes itself once with it set (`reexec_with_huge_pages`).
HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb=1"
HUGE_PAGES_ENV = "DORYLUS_HUGE_PAGES"   # "0": leave malloc as it is
_REEXECUTED_ENV = "DORYLUS_HUGE_PAGES_REEXECUTED"   # set in the re-executed process: never twice (glibc drops
                                                     # GLIBC_TUNABLES in a setuid process)
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_page_environ(environ, thp_mode: str | None, libc: str) -> dict | None:
    """The environment to re-execute with so malloc backs large chunks with huge pages, or None when there is
    nothing to gain: already set (or re-executed once), turned off with DORYLUS_HUGE_PAGES=0, THP not in madvise
    mode (`always` needs nothing, `never` gives nothing), or a libc without the tunable (glibc < 2.35, musl)."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if (environ.get(HUGE_PAGES_ENV, "1") == "0" or environ.get(_REEXECUTED_ENV)
            or "glibc.malloc.hugetlb" in tunables):
        return None
    if thp_mode is None or "[madvise]" not in thp_mode:
        return None
    name, _, version = libc.partition(" ")
    try:
        if name != "glibc" or tuple(int(v) for v in version.split(".")[:2]) < (2, 35):
            return None
    except ValueError:
        return None
    env = dict(environ)
    env["GLIBC_TUNABLES"] = f"{tunables}:{HUGE_PAGE_TUNABLE}" if tunables else HUGE_PAGE_TUNABLE
    env[_REEXECUTED_ENV] = "1"
    return env


def reexec_with_huge_pages() -> None:
    """Re-execute this process (same interpreter, same command line) with `HUGE_PAGE_TUNABLE` when it helps; call
    it first thing in a command's entry point, before anything is allocated or started. Returns when it does not."""
    import os
    import sys

    try:
        with open(_THP_MODE) as f:
            mode = f.read()
    except OSError:
        mode = None
    libc = os.confstr("CS_GNU_LIBC_VERSION") if "CS_GNU_LIBC_VERSION" in getattr(os, "confstr_names", {}) else ""
    env = huge_page_environ(os.environ, mode, libc or "")
    if env is None or not getattr(sys, "orig_argv", None) or not sys.executable:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:   # cannot re-execute (an embedded interpreter, say): run on as it is
        return
