"""The native CSR x dense kernel (ops/native): values against scipy at every width path, the fallback, the build."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp

from ops import native, sparse

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler for ops/native here")


def _skewed(rows, cols, seed, empty_rows=True):
    """A power-law-ish CSR block with sorted column indices, some empty rows and some long ones."""
    rng = np.random.default_rng(seed)
    deg = np.minimum(rng.zipf(1.6, rows), cols)
    if empty_rows:
        deg[rng.random(rows) < 0.2] = 0
    indptr = np.concatenate([[0], np.cumsum(deg)]).astype(np.int32)
    indices = np.concatenate([np.sort(rng.choice(cols, d, replace=False)) for d in deg] or [[]]).astype(np.int32)
    data = rng.standard_normal(indptr[-1]).astype(np.float32)
    return sp.csr_matrix((data, indices, indptr), shape=(rows, cols))


# 8..64 in steps of 8 take the vector path; others (and 72) the generic one; 1 is the narrowest row.
@pytest.mark.parametrize("width", [1, 3, 8, 16, 24, 40, 64, 72, 100])
@pytest.mark.parametrize("rows,cols", [(1, 5), (37, 11), (3000, 2500), (20000, 300)])
def test_kernel_equals_scipy(width, rows, cols):
    a = _skewed(rows, cols, seed=rows + width)
    x = np.random.default_rng(width).standard_normal((cols, width)).astype(np.float32)
    want = (a.astype(np.float64) @ x.astype(np.float64))
    f = jax.jit(native.csr_spmm, static_argnums=4)
    got = np.asarray(f(jnp.asarray(a.data), jnp.asarray(a.indices), jnp.asarray(a.indptr), jnp.asarray(x), rows))
    assert got.shape == (rows, width)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * max(1.0, float(np.abs(want).max(initial=0))))
    again = np.asarray(f(jnp.asarray(a.data), jnp.asarray(a.indices), jnp.asarray(a.indptr), jnp.asarray(x), rows))
    np.testing.assert_array_equal(got, again)  # deterministic: the same order of sums every call


def test_kernel_handles_no_entries_and_rows_beyond_the_columns():
    a = sp.csr_matrix((5, 3), dtype=np.float32)
    x = jnp.ones((3, 16), jnp.float32)
    got = native.csr_spmm(jnp.zeros(0, jnp.float32), jnp.zeros(0, jnp.int32), jnp.asarray(a.indptr, jnp.int32), x, 5)
    np.testing.assert_array_equal(np.asarray(got), np.zeros((5, 16), np.float32))


def test_operands_it_does_not_take_fall_back_to_bcsr():
    a = _skewed(200, 150, seed=3)
    x = np.random.default_rng(0).standard_normal(150).astype(np.float32)
    # a vector, not a [cols, F] matrix: not the kernel's shape, so BCSR computes it
    text = jax.jit(native.csr_spmm, static_argnums=4).lower(
        jnp.asarray(a.data), jnp.asarray(a.indices), jnp.asarray(a.indptr), jnp.asarray(x), 200).as_text()
    assert "dorylus_csr_spmm" not in text
    got = native.csr_spmm(jnp.asarray(a.data), jnp.asarray(a.indices), jnp.asarray(a.indptr), jnp.asarray(x), 200)
    np.testing.assert_allclose(np.asarray(got), a @ x, rtol=1e-4, atol=1e-4)


def test_gather_and_its_gradient_use_the_kernel_and_match_dense():
    a = _skewed(500, 500, seed=9)
    a = (a + a.T).tocsr()
    a.sort_indices()
    adj = sparse.Adjacency.from_scipy(a, symmetric=True).to_device()
    x = jnp.asarray(np.random.default_rng(1).standard_normal((500, 24)), jnp.float32)
    text = jax.jit(sparse.gather).lower(adj, x).as_text()
    assert "dorylus_csr_spmm" in text
    dense = jnp.asarray(a.toarray(), jnp.float32)
    np.testing.assert_allclose(np.asarray(sparse.gather(adj, x)), np.asarray(dense @ x), rtol=1e-4, atol=1e-4)
    g = jax.grad(lambda v: jnp.sum(jnp.sin(sparse.gather(adj, v))))(x)
    g_dense = jax.grad(lambda v: jnp.sum(jnp.sin(dense @ v)))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_dense), rtol=1e-4, atol=1e-4)


def _run(code, **env):
    e = {**os.environ, "JAX_PLATFORMS": "cpu", **env}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=e, capture_output=True, text=True, timeout=300)


def test_turned_off_or_unbuildable_it_warns_once_and_the_answers_are_the_same(tmp_path):
    code = (
        "import numpy as np, jax, jax.numpy as jnp, scipy.sparse as sp\n"
        "from ops import native\n"
        "a = sp.random(300, 200, density=0.05, format='csr', random_state=0, dtype=np.float32)\n"
        "x = np.random.default_rng(0).standard_normal((200, 16)).astype(np.float32)\n"
        "y = jax.jit(native.csr_spmm, static_argnums=4)(jnp.asarray(a.data), jnp.asarray(a.indices, jnp.int32),"
        " jnp.asarray(a.indptr, jnp.int32), jnp.asarray(x), 300)\n"
        "print(native.available(), float(np.abs(np.asarray(y) - a @ x).max()) < 1e-4)\n"
    )
    off = _run(code, DORYLUS_NATIVE="0")
    assert off.returncode == 0, off.stderr
    assert off.stdout.split() == ["False", "True"]
    broken = _run(code, CXX="false", DORYLUS_NATIVE_DIR=str(tmp_path / "cache"))
    assert broken.returncode == 0, broken.stderr
    assert broken.stdout.split() == ["False", "True"]
    assert broken.stderr.count("native kernels unavailable") == 1
    assert not list((tmp_path / "cache").glob("*.tmp"))  # a failed build leaves nothing behind


def test_build_command_reports_a_missing_compiler_with_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ops.native"], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "CXX": str(tmp_path / "no-such-compiler"),
                            "DORYLUS_NATIVE_DIR": str(tmp_path)})
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "native: error: cannot run" in r.stderr
    ok = subprocess.run([sys.executable, "-m", "ops.native"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and ok.stdout.strip().endswith(".so")
