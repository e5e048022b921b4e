"""Scale benchmark of the Beam prepare pipeline: an R-MAT graph -> edge files -> `dorylus prepare` on the
DirectRunner -> `dorylus train --prepared` for a few epochs -> `dorylus infer`. Prints one JSON line per step.

    python bench/prepare_scale.py                                  # 2^20 vertices, 8M undirected edges
    python bench/prepare_scale.py --scale 24                       # 2^24 vertices, 2^27 undirected (268M directed)
    python bench/prepare_scale.py --edges 1000000 --scale 16 --train whole

Steps (each one JSON line):
  generate  the R-MAT edges (pipelines.data.synthetic.rmat_edges: distinct undirected edges, no self-loops) written
            as --files CSV files ``src,dst`` (header, shuffled order) + features.npy [N, F] + labels.npy [N]
  prepare   `python -m pipelines.prepare ... --engine direct --workers W` in a subprocess: wall time, peak RSS
            of the whole process tree (driver + SDK worker processes, sampled every 0.2 s), input edges/s.
            If the pipeline's flow checks find that the runner lost elements (Beam 2.77's DirectRunner does with
            several workers at this volume, see runner-check), it is run again with one worker.
  runner-check  (only with --steps ...,runner-check) a standalone Beam pipeline showing that loss
  train     `python -m pipelines.cli train --prepared DIR ...` (engine: --partitions P --intervals I, or the
            whole-graph trainer with --train whole): wall time, peak RSS, epochs, the summary's numbers
Not part of the test run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from uuid import uuid4

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


MAX_RSS_GB = 20.0   # a step whose process tree grows past this is stopped (the machine is shared: no swap, no OOM)


def run_measured(cmd: list[str], log_path: Path, env=None) -> dict:
    """Run cmd; wall seconds, peak RSS (bytes) of its process tree, exit code. A tree above MAX_RSS_GB, or above
    what the machine has available when the step starts (less 1 GB), is killed: rc -9, ``rss_cap_gb`` set."""
    import psutil

    cap = min(MAX_RSS_GB * 2**30, psutil.virtual_memory().available - 2**30)
    capped = False

    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
        peak = 0
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            total = 0
            try:
                procs = [root] + root.children(recursive=True)
            except psutil.NoSuchProcess:
                procs = []
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
            peak = max(peak, total)
            if total > cap and not capped:
                capped = True
                for q in reversed(procs):
                    try:
                        q.kill()
                    except psutil.NoSuchProcess:
                        pass
            time.sleep(0.2)
        wall = time.perf_counter() - t0
    row = {"wall_s": round(wall, 2), "peak_rss_gb": round(peak / 2**30, 3), "rc": proc.returncode}
    if capped:
        row["rss_cap_gb"] = round(cap / 2**30, 2)
    return row


def generate(args, work: Path) -> dict:
    """The R-MAT edges (pipelines.data.synthetic.rmat_edges: no Graph is built) as CSV files, features and
    labels as .npy written in chunks; peak memory about 20 bytes per undirected edge."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    from pipelines.data.synthetic import rmat_edges

    t0 = time.perf_counter()
    src, dst, n = rmat_edges(args.scale, args.edges, seed=args.seed)
    t_gen = time.perf_counter() - t0
    rng = np.random.default_rng(args.seed)
    edges_dir = work / "edges"
    edges_dir.mkdir(parents=True, exist_ok=True)
    perm = rng.permutation(src.size).astype(np.int64)   # records in shuffled order, either direction
    bounds = np.linspace(0, src.size, args.files + 1).astype(np.int64)
    for i in range(args.files):
        with open(edges_dir / f"part-{i:03d}.csv", "wb") as f:
            f.write(b"src,dst\n")
            for lo in range(int(bounds[i]), int(bounds[i + 1]), CSV_CHUNK):
                idx = perm[lo:min(lo + CSV_CHUNK, int(bounds[i + 1]))]
                a, b = src[idx], dst[idx]
                flip = rng.random(idx.size) < 0.5
                pacsv.write_csv(pa.table({"src": np.where(flip, b, a), "dst": np.where(flip, a, b)}), f,
                                write_options=pacsv.WriteOptions(include_header=False))
    m = int(src.size)
    del src, dst, perm
    feats = np.lib.format.open_memmap(work / "features.npy", mode="w+", dtype=np.float32,
                                      shape=(n, args.feature_dim))
    for lo in range(0, n, CSV_CHUNK):
        hi = min(lo + CSV_CHUNK, n)
        feats[lo:hi] = rng.standard_normal((hi - lo, args.feature_dim), dtype=np.float32)
    feats.flush()
    del feats
    np.save(work / "labels.npy", rng.integers(0, args.classes, size=n, dtype=np.int32))
    size = sum(f.stat().st_size for f in edges_dir.iterdir())
    return {"step": "generate", "vertices": n, "undirected_edges": m, "directed_edges": 2 * m,
            "files": args.files, "edge_bytes": size, "generate_s": round(t_gen, 2),
            "total_s": round(time.perf_counter() - t0, 2), "peak_rss_gb": round(_self_peak_gb(), 3)}


CSV_CHUNK = 1 << 22   # rows per write (and feature rows per draw)


def _self_peak_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=int, default=20, help="2^scale vertices (default 20)")
    ap.add_argument("--edges", type=int, help="distinct undirected edges (default 2^(scale+3): 8 per vertex, "
                                               "so --scale 24 is 2^27 undirected, 268M directed edges)")
    ap.add_argument("--feature-dim", type=int, default=32)
    ap.add_argument("--classes", type=int, default=8)
    ap.add_argument("--files", type=int, default=8, help="edge files (CSV)")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--workers", type=int, default=1, help="DirectRunner worker processes (Beam 2.77 loses "
                                                            "elements with several at ~1 GB: see runner-check)")
    ap.add_argument("--train", choices=("engine", "whole", "none"), default="engine")
    ap.add_argument("--intervals", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--infer-engine", choices=("direct", "flink"), default="direct",
                    help="the Beam runner of the infer step (flink: an embedded Flink cluster, which spills its "
                         "shuffles to disk where the DirectRunner holds them in memory)")
    ap.add_argument("--work", help="working directory (default: a temporary one, removed afterwards)")
    ap.add_argument("--steps", default="generate,prepare,train,infer",
                    help="comma-separated steps to run; later steps reuse --work's earlier results")
    ap.add_argument("--max-rss-gb", type=float, default=MAX_RSS_GB, help="stop a step above this peak RSS")
    ap.add_argument("--check-rows", type=int, default=1_000_000, help="runner-check: rows per produced element")
    args = ap.parse_args(argv)
    if args.edges is None:
        args.edges = 1 << (args.scale + 3)
    globals()["MAX_RSS_GB"] = args.max_rss_gb   # run_measured's cap
    steps = set(args.steps.split(","))

    tmp = None
    if args.work:
        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="dorylus-prepare-scale-")
        work = Path(tmp.name)
    try:
        out = work / "prepared"
        if "generate" in steps:
            gen = generate(args, work)
            emit(**gen)
        else:
            gen = None
        if "runner-check" in steps:
            emit(**runner_check(args.workers, rows=args.check_rows))
        if "prepare" not in steps:
            rc = train_step(args, work, out) if "train" in steps else 0
            return infer_step(args, work, out) if rc == 0 and "infer" in steps else rc
        for workers in dict.fromkeys([args.workers, 1]):   # one worker again only if the parallel run failed
            m, row = prepare_step(args, work, out, workers)
            if m["rc"] == 0 or "lost or duplicated elements" not in row.get("log_tail", ""):
                break
        if m["rc"] == 0:
            manifest = json.loads((out / "manifest.json").read_text())
            c = manifest["counters"]
            row.update(input_edges=c["input_records"], edges_per_s=round(c["input_records"] / m["wall_s"]),
                       directed_edges=manifest["num_edges"], vertices=manifest["num_vertices"],
                       duplicates=c["duplicate_edges"], partitions=manifest["num_partitions"],
                       shard_bytes=sum(p["edges_bytes"] + p["vertices_bytes"] for p in manifest["partitions"]),
                       rss_bytes_per_directed_edge=round(m["peak_rss_gb"] * 2**30 / max(manifest["num_edges"], 1), 1))
            if gen is not None:
                assert manifest["num_edges"] == gen["directed_edges"], (manifest["num_edges"], gen["directed_edges"])
            emit(**row)
        if m["rc"] != 0 or args.train == "none" or "train" not in steps:
            return m["rc"]
        rc = train_step(args, work, out)
        return infer_step(args, work, out) if rc == 0 and "infer" in steps else rc
    finally:
        if tmp is not None:
            tmp.cleanup()


def prepare_step(args, work: Path, out: Path, workers: int) -> tuple[dict, dict]:
    cmd = [sys.executable, "-m", "pipelines.prepare", "--edges", str(work / "edges" / "part-*.csv"),
           "--features", str(work / "features.npy"), "--labels", str(work / "labels.npy"), "--split",
           "--partitions", str(args.partitions), "--out", str(out), "--overwrite", "--engine", "direct",
           "--workers", str(workers)]
    m = run_measured(cmd, work / "prepare.log")
    mode = f"multi_processing x{workers}" if workers > 1 else "in_memory (one worker)"
    row = {"step": "prepare", "runner": f"DirectRunner {mode}", **m}
    if m["rc"] != 0:
        lines = [ln for ln in (work / "prepare.log").read_text().splitlines() if "apitools" not in ln]
        row["log_tail"] = "\n".join(lines[-5:])[-1500:]
        emit(**row)
    return m, row


def _produce(i, side, rows, parts):
    from apache_beam import pvalue

    yield pvalue.TaggedOutput("stats", rows)
    for p in range(parts):
        yield p, np.full((rows // parts, 8), float(side), np.float32)


def _count_rows(kv) -> dict:
    return {t: sum(a.shape[0] for a in v) for t, v in kv[1].items()}


def _save_json(obj, d: str) -> None:
    Path(d, f"{uuid4().hex}.json").write_text(json.dumps(obj))


def runner_check(workers: int, parts: int = 4, rows: int = 1_000_000,
                 inputs=(("a", 16), ("b", 1), ("c", 8))) -> dict:
    """Beam's DirectRunner with several workers (multi_processing, multi_threading) against one worker: three
    producer stages (a side input, a tagged output) into one CoGroupByKey; rows that arrive per tag. In Beam
    2.77 the parallel modes drop whole elements at this volume (~1 GB); one worker is exact."""
    want = {tag: n * rows for tag, n in inputs}
    out = {"step": "runner-check", "expected_rows": want}
    for mode in ("multi_processing", "multi_threading", "in_memory"):
        n = 1 if mode == "in_memory" else workers
        flags = [f"--direct_running_mode={mode}", f"--direct_num_workers={n}"]
        got: dict = {}
        try:
            _check_pipeline(flags, inputs, rows, parts, got)
        except Exception as e:   # the parallel modes may also corrupt the stream: a decoding error
            out[f"{mode} x{n}"] = {"rows": got, "exact": False, "error": str(e).strip().splitlines()[-1][:300]}
            continue
        out[f"{mode} x{n}"] = {"rows": got, "exact": got == want}
    return out


def _check_pipeline(flags, inputs, rows, parts, got) -> None:
    import apache_beam as beam
    from apache_beam import pvalue
    from apache_beam.options.pipeline_options import PipelineOptions

    with tempfile.TemporaryDirectory() as d:
        with beam.Pipeline(options=PipelineOptions(flags)) as p:
            side = p | "Side" >> beam.Create([1])
            tagged = {}
            for tag, k in inputs:
                produced = (p | f"Create{tag}" >> beam.Create(list(range(k)))
                            | f"Shuffle{tag}" >> beam.Reshuffle()
                            | f"Produce{tag}" >> beam.FlatMap(_produce, side=pvalue.AsSingleton(side),
                                                              rows=rows, parts=parts)
                            .with_outputs("stats", main="rows"))
                tagged[tag] = produced.rows
            tagged | beam.CoGroupByKey() | beam.Map(_count_rows) | beam.Map(_save_json, d=d)
        for f in Path(d).iterdir():
            for t, c in json.loads(f.read_text()).items():
                got[t] = got.get(t, 0) + c


def train_step(args, work: Path, out: Path) -> int:
    run_dir = work / "run"
    cmd = [sys.executable, "-m", "pipelines.cli", "train", "--prepared", str(out), "--epochs", str(args.epochs),
           "--patience", "0", "--out", str(run_dir), "--overwrite", "--quiet"]
    if args.train == "engine":
        cmd += ["--partitions", str(args.partitions), "--intervals", str(args.intervals)]
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    t = run_measured(cmd, work / "train.log", env=env)
    row = {"step": "train", "trainer": "engine" if args.train == "engine" else "whole-graph", **t}
    if t["rc"] == 0:
        s = json.loads((run_dir / "summary.json").read_text())
        row.update(epochs=s["epochs"], epoch_s_median=round(s["epoch_s_median"], 2),
                   final_loss=s["final_loss"], seconds=round(s["seconds"], 2))
        if args.train == "engine":
            row.update(partitions=s["partitions"], intervals=s["intervals"],
                       partitioner=s["partition_stats"]["partitioner"])
    else:
        row["log_tail"] = (work / "train.log").read_text()[-2000:]
    emit(**row)
    return t["rc"]


def infer_step(args, work: Path, out: Path) -> int:
    """`dorylus infer` over the trained run (Beam, DirectRunner): wall time, peak RSS, predictions written."""
    pred = work / "predictions"
    cmd = [sys.executable, "-m", "pipelines.cli", "infer", "--run", str(work / "run"), "--prepared", str(out),
           "--out", str(pred), "--overwrite", "--no-embeddings", "--engine", args.infer_engine]
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    t = run_measured(cmd, work / "infer.log", env=env)
    row = {"step": "infer", "engine": args.infer_engine, **t}
    if t["rc"] == 0 and (pred / "infer.json").is_file():
        info = json.loads((pred / "infer.json").read_text())
        row.update({k: info[k] for k in ("num_vertices", "num_edges") if k in info})
    else:
        row["log_tail"] = (work / "infer.log").read_text()[-2000:]
    emit(**row)
    return t["rc"]


if __name__ == "__main__":
    from ops.host import reexec_with_huge_pages

    reexec_with_huge_pages()   # before anything is allocated: see ops.host.HUGE_PAGE_TUNABLE
    sys.exit(main())
