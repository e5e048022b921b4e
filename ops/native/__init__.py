"""Native CPU kernels (C++ through XLA's FFI), built once per machine under .cache/native; optional at run time.

    python -m ops.native            # build (or find) the library and print its path; exit 2 if it cannot be built

The one kernel so far is the GA's CSR x dense product (``csr_spmm.cc``): jaxlib's CPU kernel (Eigen) waits on each
random row read once the rows outgrow the last-level cache, so its cost per edge grows with the graph; this one
prefetches ahead (see the source). :func:`csr_spmm` uses it when the library is there and the operands fit
(float32 values and rows, int32 indices) and falls back to ``jax.experimental.sparse.BCSR`` otherwise, so the
project runs without a C++ compiler (an AWS Lambda image, say). The first use builds the library with ``$CXX``
(default ``g++``) for this CPU (``-march=native``, so the cache is keyed by the CPU's flags as well as the sources
and jaxlib's version). ``DORYLUS_NATIVE=0`` turns the kernels off; ``DORYLUS_NATIVE_DIR`` moves the cache (default:
the checkout's ``.cache/native``, else ``~/.cache/dorylus/native``). Both paths sum each row's entries in a fixed
order, so each is deterministic; they differ only in floating-point rounding.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("dorylus.native")

SOURCES = ("csr_spmm.cc",)
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-march=native", "-w")
_HERE = Path(__file__).resolve().parent
_STATE: dict = {}


class NativeBuildError(RuntimeError):
    """The kernels could not be compiled here (no compiler, or it failed); the message ends with its output."""


def cache_dir() -> Path:
    """$DORYLUS_NATIVE_DIR, else the checkout's .cache/native (beside the other cached tools), else the user's cache."""
    if os.environ.get("DORYLUS_NATIVE_DIR"):
        return Path(os.environ["DORYLUS_NATIVE_DIR"])
    if (_HERE.parents[1] / "pyproject.toml").is_file():
        return _HERE.parents[1] / ".cache" / "native"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dorylus" / "native"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def library_path() -> Path:
    """Where this machine's build of the current sources lives (the name is a digest of everything it depends on)."""
    import jaxlib

    h = hashlib.sha256()
    for name in SOURCES:
        h.update((_HERE / name).read_bytes())
    h.update(" ".join(FLAGS).encode())
    h.update(f"{jaxlib.__version__} {platform.machine()} {_cpu_flags()}".encode())
    return cache_dir() / f"libdorylus-{h.hexdigest()[:16]}.so"


def build() -> Path:
    """Compile the kernels unless this machine's build exists; returns the library's path (written atomically)."""
    import jax

    out = library_path()
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    cxx = shlex.split(os.environ.get("CXX", "g++"))
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    cmd = [*cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", *(str(_HERE / s) for s in SOURCES), "-o", tmp]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        os.unlink(tmp)
        raise NativeBuildError(f"cannot run {cxx[0]}: {e}") from None
    if r.returncode != 0:
        os.unlink(tmp)
        raise NativeBuildError(f"{' '.join(cmd[:2])} ... failed: {(r.stderr or r.stdout).strip()[-800:]}")
    os.replace(tmp, out)
    return out


def available() -> bool:
    """Whether the kernels are loaded (building them on first use); False, with one warning, where they cannot be."""
    if "ok" in _STATE:
        return _STATE["ok"]
    ok = False
    if os.environ.get("DORYLUS_NATIVE", "1") != "0":
        try:
            import jax

            lib = ctypes.cdll.LoadLibrary(str(build()))
            jax.ffi.register_ffi_target("dorylus_csr_spmm", jax.ffi.pycapsule(lib.dorylus_csr_spmm), platform="cpu")
            ok = True
        except (NativeBuildError, OSError, AttributeError) as e:
            log.warning("native kernels unavailable, using jax.experimental.sparse: %s", e)
    _STATE["ok"] = ok
    return ok


def csr_spmm(data, indices, indptr, x, nrows: int):
    """y = A · x for the CSR matrix A = (data, indices, indptr) of ``nrows`` rows and x [cols, F]: the native kernel
    when it is available and the operands fit it, else BCSR."""
    import jax
    import jax.numpy as jnp

    fits = (x.ndim == 2 and x.dtype == jnp.float32 and data.dtype == jnp.float32
            and indices.dtype == jnp.int32 and indptr.dtype == jnp.int32 and indptr.shape[0] == nrows + 1)
    if fits and jax.default_backend() == "cpu" and available():
        call = jax.ffi.ffi_call("dorylus_csr_spmm", jax.ShapeDtypeStruct((nrows, x.shape[1]), jnp.float32))
        return call(data, indices, indptr, x)
    from jax.experimental import sparse as jsparse

    return jsparse.BCSR((data, indices, indptr), shape=(nrows, x.shape[0])) @ x


def main(argv=None) -> int:
    try:
        print(build())
    except NativeBuildError as e:
        print(f"native: error: {e}", file=sys.stderr)
        return 2
    return 0
