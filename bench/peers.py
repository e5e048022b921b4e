"""Bench: this project, DGL and PyG on the same generated graph in one run: epoch seconds and peak RSS of GCN
and GAT full-graph training, and this project's ratios to each peer. Not part of CI.

One planted-partition graph (ogbn-arxiv's size by default: 169,343 vertices, 1,166,243 undirected edges, 128
features, 40 classes) is generated once and written to a temporary .npz; every (framework, model) then runs in
its own process (bench/peer_epochs.py), so each peak RSS is that run's alone. A peer runs under the Python of
its own virtual environment, `<venvs>/dgl` or `<venvs>/pyg` (`--venvs`, default `$DORYLUS_CACHE/venvs`), and
is skipped with a note when that environment is missing or cannot import the library. Environments that work:
  dgl: torch==2.2.1 dgl==2.1.0 "numpy<2" "pandas<2.3" torchdata==0.7.1 pydantic pyyaml scipy psutil
  pyg: torch torch_geometric
Example: python bench/peers.py --epochs 5   (JSON lines: one per run, then one ratio line per model and peer)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PEERS = {"dgl": "import dgl, torch", "pyg": "import torch_geometric, torch"}


def peer_python(venvs: Path, peer: str) -> tuple[str | None, str]:
    """The peer environment's python, or None and why not."""
    py = venvs / peer / "bin" / "python"
    if not py.exists():
        return None, f"no environment at {venvs / peer}"
    r = subprocess.run([str(py), "-c", PEERS[peer]], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["import failed"])[-1]
        return None, f"{venvs / peer} cannot import it: {last}"
    return str(py), ""


def write_graph(args, path: Path) -> dict:
    import numpy as np

    from pipelines.data.synthetic import planted_partition

    g = planted_partition(num_nodes=args.nodes, num_classes=args.classes,
                          avg_degree=2.0 * args.edges / args.nodes, feature_dim=args.features, seed=args.seed)
    upper = g.adj.tocoo()
    keep = upper.row < upper.col  # each undirected edge once; every framework adds both directions
    np.savez(path, src=upper.row[keep].astype(np.int64), dst=upper.col[keep].astype(np.int64),
             features=g.features.astype(np.float32), labels=g.labels.astype(np.int64), train=g.train_mask)
    return {"nodes": g.num_nodes, "edges_directed": g.num_edges, "features": args.features,
            "classes": args.classes}


def run_one(python: str, framework: str, model: str, graph: Path, args) -> dict:
    cmd = [python, str(ROOT / "bench" / "peer_epochs.py"), "--framework", framework, "--model", model,
           "--graph", str(graph), "--epochs", str(args.epochs),
           "--hidden", str(args.gcn_hidden if model == "gcn" else args.gat_hidden), "--heads", str(args.heads)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)} if framework == "dorylus" else {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return {"bench": "peer-epochs", "framework": framework, "model": model, "error": last[-300:]}
    return json.loads(lines[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=169_343)
    p.add_argument("--edges", type=int, default=1_166_243, help="undirected edges")
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--classes", type=int, default=40)
    p.add_argument("--gcn-hidden", type=int, default=256)
    p.add_argument("--gat-hidden", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--epochs", type=int, default=5, help="timed epochs after the first")
    p.add_argument("--models", nargs="+", default=["gcn", "gat"], choices=["gcn", "gat"])
    p.add_argument("--peers", nargs="+", default=list(PEERS), choices=list(PEERS))
    p.add_argument("--venvs", default=None, help="folder of the peer environments (default $DORYLUS_CACHE/venvs)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    venvs = Path(args.venvs or Path(os.environ.get("DORYLUS_CACHE", ROOT / ".cache")) / "venvs")

    pythons = {}
    for peer in args.peers:
        py, why = peer_python(venvs, peer)
        if py is None:
            print(json.dumps({"bench": "peer-skipped", "framework": peer, "note": why}), flush=True)
        else:
            pythons[peer] = py
    with tempfile.TemporaryDirectory(prefix="dorylus-peers-") as tmp:
        graph = Path(tmp) / "graph.npz"
        info = write_graph(args, graph)
        print(json.dumps({"bench": "peer-graph", **info, "load_avg": os.getloadavg()[0]}), flush=True)
        for model in args.models:
            ours = run_one(sys.executable, "dorylus", model, graph, args)
            print(json.dumps(ours), flush=True)
            for peer, py in pythons.items():
                theirs = run_one(py, peer, model, graph, args)
                print(json.dumps(theirs), flush=True)
                if "error" in ours or "error" in theirs:
                    continue
                print(json.dumps({
                    "bench": "peer-ratio", "model": model, "peer": peer, "peer_version": theirs.get("version"),
                    "epoch_ratio": ours["epoch_s_median"] / theirs["epoch_s_median"],
                    "rss_ratio": ours["peak_rss_mb"] / theirs["peak_rss_mb"],
                    "epoch_s": [ours["epoch_s_median"], theirs["epoch_s_median"]],
                    "peak_rss_mb": [ours["peak_rss_mb"], theirs["peak_rss_mb"]]}), flush=True)
    return 0


if __name__ == "__main__":
    from ops.host import reexec_with_huge_pages

    reexec_with_huge_pages()   # before anything is allocated: see ops.host.HUGE_PAGE_TUNABLE
    sys.exit(main())
