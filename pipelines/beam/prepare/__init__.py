"""Prepare a graph for Dorylus: validate, symmetrize, normalize, partition and shard it (an Apache Beam pipeline).

    python -m pipelines.prepare --edges 'data/g/edges-*.csv' --features data/g/x.npy --labels data/g/y.npy \\
        --partitions 4 --partitioner metis --split --out runs/g-prepared            # DirectRunner
    python -m pipelines.prepare ... --engine direct --workers 2                     # DirectRunner, 2 processes
    python -m pipelines.prepare ... --engine flink                                  # embedded Flink cluster
    python -m pipelines.prepare ... --runner=FlinkRunner --flink_master=host:8081    # any Beam runner flags

App flags are parsed with argparse; every other flag goes to Beam's PipelineOptions (``--runner=...``);
``--engine direct|flink`` expands to the flags of :func:`pipelines.beam.runners.runner_options`.

Inputs
------
--edges GLOB      one or more files (a glob, e.g. ``part-*.csv``); ``.parquet``/``.pq`` files are Parquet, all
                  others text (``.gz``/``.bz2``/... are decompressed by Beam). Text: one edge ``src dst`` per line,
                  separated by a comma, a tab or spaces; ``#`` starts a comment (whole line or trailing); blank lines
                  are skipped; the first data line of each file is a header (skipped) when every field of it starts
                  with a letter or ``_`` (``src,dst``). Parquet: columns ``src`` and ``dst`` (else the first two).
                  A line (row) that is not exactly two integers is a *bad record*: reported as ``file:line: why``
                  and counted; more than ``--max-bad-records`` (default 0) of them fail the run.
                  Ids outside [0, N) fail the run. Self-loops and duplicate edges are dropped and counted.
--features PATH   ``.npy`` float array [N, F] (row i = vertex i), or Parquet: an optional integer id column
                  ``vertex`` (or ``node``, ``node_id``, ``id``; without one, row i = vertex i) and either one list
                  column (``features``, ``fixed_size_list<float32>[F]`` preferred, any numeric list accepted) or,
                  failing that, every other numeric column as one feature (wide format, in schema order).
                  NaN/inf, rows of another width, missing or repeated vertices fail the run.
--labels PATH     ``.npy`` int array [N], or Parquet with a ``label`` column (else the only non-id column) and
                  the optional id column; -1 or null = unlabelled.
--split           a seeded per-class split of the labelled vertices (``--train-per-class``, ``--val-per-class``);
--split-file PATH or a given one: ``.npy`` int array [N] (or Parquet ``split`` column + optional id column) of the
                  codes of :data:`schemas.files.SPLIT_CODES`: -1 none, 0 train, 1 val, 2 test.
--num-nodes N     default: the row count of --features (else of --labels), else max edge id + 1.

Outputs (``--out DIR``)
-----------------------
DIR/edges/part-XXXXX.parquet     :data:`schemas.files.EDGE_SHARD_SCHEMA` (src int64, dst int64, weight float32):
                                 the nonzeros of Â = D^-1/2 (A + I) D^-1/2 whose *destination* (row) vertex the
                                 partition owns, self-loops included, sorted by (dst, src); weight = Â[dst, src]
                                 = 1/sqrt(deg_src) * 1/sqrt(deg_dst), deg counting the self-loop.
DIR/vertices/part-XXXXX.parquet  :func:`schemas.files.vertex_shard_schema` (vertex int64, partition int32,
                                 degree int32 [with self-loop], features fixed_size_list<float32>[F] [absent
                                 when F = 0], label int32 [-1 none], split int8 [SPLIT_CODES]), sorted by vertex.
DIR/manifest.json                passes :func:`schemas.files.validate_manifest`: sizes, one entry per partition
                                 (paths, row counts, sha256), counters, the flags used.

The run is atomic: everything is written into ``DIR.tmp-<uuid>`` next to DIR, the manifest is written last, and
the directory is renamed to DIR only when every check passed; on any error the temporary directory is removed,
so a DIR with a manifest.json is always complete. An existing DIR is replaced only with ``--overwrite``.

How it scales
-------------
Elements are numpy *chunks*, never single edges: a reader parses ~16 MiB of text (Arrow's CSV parser; a block
with a comment, a bad line or odd spacing is re-split and the failing lines parsed one by one, so bad records
keep their file and line) or one Parquet record batch into one chunk of edges; validation, symmetrization and
routing are vectorized per chunk. One shuffle moves every directed edge entry to the partition that owns its
destination (the graph server that will gather over it); there the entries are sorted and deduplicated
(``np.sort`` of packed uint64 keys, in place), degrees counted and the vertex shard written. Degrees are then
broadcast as a side input (8 bytes per vertex) so that each partition can weight its edges and write its edge
shard. The bulk never goes through Beam's shuffles: edge entries, feature rows and each partition's sorted
entries are *spilled* chunk by chunk to ``DIR.tmp-<uuid>/_spill/`` and only (path, count) elements are shuffled
(``spill.py``; the DirectRunner holds every shuffled element in memory), so the driver's memory is bounded by
one partition's work: about 17 bytes per entry of the largest partition while it is sorted, plus its features.
A partition's shard is built in one worker's memory (as a Dorylus graph server holds its partition);
``--partitioner metis`` and ``--split`` collect the whole edge list / label vector in one worker (METIS and the
per-class permutation need them); the partition assignment of ``metis``/``file`` is broadcast (4 bytes/vertex).
The output paths must be on a file system that the workers and this process share (local or mounted).

Layout (one transform family per module, as Beam's own transforms)
------------------------------------------------------------------
read_edges.py  ReadEdges: text/Parquet edge files -> EdgeChunk (``read_text``, ``read_parquet``)
validate.py    Validate: ids in range, self-loops dropped
partition.py   AssignPartitions (hash, METIS, file) and Symmetrize (both directions routed to their owner)
tables.py      ReadTable and the driver's inspect_features/inspect_labels: feature, label and split files
split.py       Split: the seeded per-class split
shards.py      BuildPartitions (dedupe, vertex shards) and WriteEdgeShards (Â weights)
spill.py       chunks of arrays written to the staging folder; only their paths are shuffled
options.py     the app flags (argparse) and their checks -> Config
manifest.py    the merged stats -> errors and the manifest
pipeline.py    ``build(p, cfg, root)``, ``run(argv)`` and ``main``

Shared with the infer pipeline: :mod:`pipelines.beam.combiners` (the stats channel) and
:mod:`pipelines.beam.writers` (shards with sha256, staged output folders). Reading a prepared graph back needs no
Beam: :mod:`pipelines.data.prepared`.
"""
from pipelines.beam.prepare.options import Config, build_parser, make_config
from pipelines.beam.prepare.pipeline import build, main, run, summary_line
from pipelines.beam.prepare.read_edges import EdgeChunk, read_text
from pipelines.beam.prepare.shards import EDGE_SCHEMA, vertex_schema

__all__ = ["Config", "EDGE_SCHEMA", "EdgeChunk", "build", "build_parser", "main", "make_config", "read_text", "run",
           "summary_line", "vertex_schema"]
