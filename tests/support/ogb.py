"""Writes small graphs in OGB's node-property directory layout for the OGB loader's tests."""
import gzip

import numpy as np


def gz(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        f.write("".join(r + "\n" for r in rows))


def write_ogb(root, graph, splits=("time",), directed=True):
    """graph in OGB's layout under root: raw/*.csv.gz, split/<name>/*.csv.gz (edges once, as ogbn-arxiv)."""
    coo = graph.adj.tocoo()
    keep = coo.row < coo.col if directed else np.ones(coo.nnz, bool)
    gz(root / "raw" / "edge.csv.gz", [f"{s},{d}" for s, d in zip(coo.row[keep], coo.col[keep])])
    gz(root / "raw" / "node-feat.csv.gz", [",".join(f"{v:.6f}" for v in row) for row in graph.features])
    gz(root / "raw" / "node-label.csv.gz", [str(v) if v >= 0 else "" for v in graph.labels])
    gz(root / "raw" / "num-node-list.csv.gz", [str(graph.num_nodes)])
    gz(root / "raw" / "num-edge-list.csv.gz", [str(int(keep.sum()))])
    for name in splits:
        for part, mask in (("train", graph.train_mask), ("valid", graph.val_mask), ("test", graph.test_mask)):
            gz(root / "split" / name / f"{part}.csv.gz", [str(i) for i in np.flatnonzero(mask)])
    return root
