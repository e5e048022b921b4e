"""The pipelined engine's partitions on a stream (`pipelines.continuous.ownership`): partitioned once, vertices never
move as the graph grows, new ones join the partition of their neighbours within the balance bound, and the graph
is partitioned again only when balance or the edge cut degrades; the ownership survives a checkpoint chain."""
import numpy as np
import scipy.sparse as sp

from pipelines.continuous.ownership import MAX_BALANCE, Ownership


def _sym(n, src, dst):
    a = sp.coo_matrix((np.ones(len(src)), (src, dst)), shape=(n, n)).tocsr()
    a = ((a + a.T) > 0).astype(np.float32)
    a.setdiag(0)
    a.eliminate_zeros()
    return sp.csr_matrix(a)


def _communities(k, size, rng, p_in=0.2):
    """k dense communities of `size` vertices (ids community-major), a few edges between them."""
    src, dst = [], []
    for c in range(k):
        base = c * size
        m = int(p_in * size * size / 2)
        src += list(base + rng.integers(0, size, m))
        dst += list(base + rng.integers(0, size, m))
    n = k * size
    src += list(rng.integers(0, n, n // 20))
    dst += list(rng.integers(0, n, n // 20))
    return n, np.array(src), np.array(dst)


def test_new_vertices_join_their_neighbours_partition_and_old_ones_stay():
    rng = np.random.default_rng(0)
    n, src, dst = _communities(4, 100, rng)
    own = Ownership(4, "metis", seed=0)
    order = np.arange(n)
    a1, info = own.assignment(_sym(n, src, dst), order)
    assert info["repartitioned"] and info["repartition_reason"] == "initial" and info["repartitions"] == 1
    first = a1.parts.copy()
    # 40 new vertices, each with 5 edges into community c (new ids after the old ones, slots in arrival order)
    new = np.arange(n, n + 40)
    comm = np.arange(40) % 4
    s2 = np.repeat(new, 5)
    d2 = np.repeat(comm * 100, 5) + rng.integers(0, 100, 200)
    a2, info = own.assignment(_sym(n + 40, np.r_[src, s2], np.r_[dst, d2]), np.arange(n + 40))
    assert not info["repartitioned"] and info["repartitions"] == 1
    assert (a2.parts[:n] == first).all(), "no old vertex moves"
    # each new vertex sits where most of its neighbours are (its community's partition)
    home = np.array([np.bincount(first[c * 100:(c + 1) * 100], minlength=4).argmax() for c in range(4)])
    assert (a2.parts[n:] == home[comm]).mean() >= 0.9
    assert info["partition_balance"] <= MAX_BALANCE


def test_vertex_order_is_by_slot_not_by_id():
    """The materialized graph orders vertices by id; the ownership is kept by slot (arrival)."""
    rng = np.random.default_rng(1)
    n, src, dst = _communities(2, 60, rng)
    own = Ownership(2, "metis", seed=0)
    perm = rng.permutation(n)           # vertex i of the graph is slot perm[i]
    a1, _ = own.assignment(_sym(n, src, dst), perm)
    assert (own.parts[perm] == a1.parts).all()
    perm2 = np.r_[perm, n]              # one new vertex, last by id and by slot
    a2, _ = own.assignment(_sym(n + 1, np.r_[src, n], np.r_[dst, 0]), perm2)
    assert (a2.parts[:n] == a1.parts).all()


def test_a_degraded_cut_or_balance_repartitions_and_says_why():
    rng = np.random.default_rng(2)
    n, src, dst = _communities(4, 100, rng)
    own = Ownership(4, "metis", seed=0)
    own.assignment(_sym(n, src, dst), np.arange(n))
    base = own.base_cut
    # 400 new vertices whose edges go anywhere: no placement keeps the cut near the communities' one
    m = 400
    s2 = np.repeat(np.arange(n, n + m), 6)
    d2 = rng.integers(0, n + m, 6 * m)
    _, info = own.assignment(_sym(n + m, np.r_[src, s2], np.r_[dst, d2]), np.arange(n + m))
    assert info["repartitioned"] and info["repartition_reason"].startswith("edge cut"), info
    assert info["repartitions"] == 2 and own.base_cut != base
    # balance: an ownership far off balance (as if the bound were tighter than what placement kept)
    own2 = Ownership(2, "metis", seed=0, max_balance=1.0001)
    own2.assignment(_sym(n, src, dst), np.arange(n))
    _, info = own2.assignment(_sym(n + 3, np.r_[src, n, n + 1, n + 2], np.r_[dst, 0, 1, 2]), np.arange(n + 3))
    assert info["repartitioned"] and info["repartition_reason"].startswith("balance"), info


def test_checkpoint_pieces_restore_the_same_ownership():
    rng = np.random.default_rng(3)
    n, src, dst = _communities(2, 50, rng)
    own = Ownership(2, "metis", seed=0)
    own.assignment(_sym(n, src, dst), np.arange(n))
    pieces = [own.checkpoint(full=True)]
    own.saved()
    own.assignment(_sym(n + 10, np.r_[src, np.arange(n, n + 10)], np.r_[dst, np.arange(10)]), np.arange(n + 10))
    start, parts = own.checkpoint()
    assert start == n and parts.size == 10, "a delta holds only the slots placed since"
    pieces.append((start, parts))
    own.saved()
    back = Ownership(2, "metis", seed=0)
    back.restore(pieces, own.base_cut, own.repartitions)
    assert (back.parts == own.parts).all() and back.base_cut == own.base_cut
    start, parts = back.checkpoint()
    assert start == n + 10 and parts.size == 0, "a restored ownership continues the chain"


def test_ownership_pieces_round_trip_through_checkpoint_files_and_an_uncommitted_one(tmp_path):
    import pytest

    from pipelines.continuous import checkpoint as ckpt
    from schemas.events import EVENT_SCHEMA

    rng = np.random.default_rng(4)
    n, src, dst = _communities(2, 50, rng)
    own = Ownership(2, "metis", seed=0)

    def save(full, owner, before_commit=None):
        ckpt.save(tmp_path, meta={"round": 0}, params=None, opt_leaves=None, pending=EVENT_SCHEMA.empty_table(),
                  keys={}, graph={"x": np.zeros(1)} if full else None,
                  events=None if full else EVENT_SCHEMA.empty_table(), owner=owner, before_commit=before_commit)

    own.assignment(_sym(n, src, dst), np.arange(n))
    save(True, own.checkpoint(full=True))
    own.saved()
    own.assignment(_sym(n + 5, np.r_[src, np.arange(n, n + 5)], np.r_[dst, np.arange(5)]), np.arange(n + 5))
    save(False, own.checkpoint())
    own.saved()
    committed = own.parts.copy()
    own.assignment(_sym(n + 9, np.r_[src, np.arange(n, n + 9)], np.r_[dst, np.arange(9)]), np.arange(n + 9))

    def die(info):
        raise RuntimeError("killed before the commit")

    with pytest.raises(RuntimeError):
        save(False, own.checkpoint(), before_commit=die)  # written, never committed
    state = ckpt.load(tmp_path)
    assert [s for s, _ in state["owners"]] == [0, n]
    back = Ownership(2, "metis", seed=0)
    back.restore(state["owners"], own.base_cut, own.repartitions)
    assert (back.parts == committed).all(), "the uncommitted piece is not part of the restored ownership"
