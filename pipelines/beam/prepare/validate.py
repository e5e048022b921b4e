"""Validate: edge chunks -> int32 (src, dst) arrays of the edges whose ids are in range, without self-loops."""
from __future__ import annotations

import numpy as np

import apache_beam as beam
from apache_beam import pvalue

from pipelines.beam.combiners import SAMPLES, stat_outputs
from pipelines.beam.prepare.read_edges import EdgeChunk

ID_LIMIT = 2**31 - 1          # CSR indices are int32 throughout the system


def _kept_lines(chunk: EdgeChunk, keep: np.ndarray):
    if isinstance(chunk.lines, int):
        return np.flatnonzero(keep).astype(np.int64) + chunk.lines
    return chunk.lines[keep]


class _ValidateChunk(beam.DoFn):
    def __init__(self, limit: int, limit_source: str):
        self.limit = limit
        self.limit_source = limit_source

    def process(self, chunk: EdgeChunk):
        src, dst, limit = chunk.src, chunk.dst, self.limit
        src_bad = (src < 0) | (src >= limit)
        bad = src_bad | (dst < 0) | (dst >= limit)
        if bad.any():
            idx = np.flatnonzero(bad)
            samples = []
            for i in idx[:SAMPLES]:
                v = int(src[i] if src_bad[i] else dst[i])
                samples.append(f"{chunk.path}:{chunk.line(i)}: vertex id {v} out of range [0, {limit}) "
                               f"({self.limit_source})")
            yield from stat_outputs("ids_out_of_range", idx.size, samples)
            keep = ~bad
            src, dst = src[keep], dst[keep]
            chunk = EdgeChunk(chunk.path, _kept_lines(chunk, keep), src, dst)
        if not src.size:
            return
        yield pvalue.TaggedOutput("max_id", int(max(src.max(), dst.max())))
        loops = src == dst
        if loops.any():
            idx = np.flatnonzero(loops)
            yield from stat_outputs("self_loops", idx.size, [f"{chunk.path}:{chunk.line(i)}" for i in idx[:SAMPLES]])
            src, dst = src[~loops], dst[~loops]
        if src.size:
            yield src.astype(np.int32), dst.astype(np.int32)


class Validate(beam.PTransform):
    """EdgeChunk -> {'edges': (src, dst) int32 arrays of valid non-loop edges, 'max_id': int, 'stats': Stat}.

    ``num_nodes``: ids must lie in [0, num_nodes); None = any id in [0, 2**31 - 1) (N is inferred afterwards).
    """

    def __init__(self, num_nodes: int | None, num_nodes_source: str = "--num-nodes"):
        super().__init__()
        self.limit = ID_LIMIT if num_nodes is None else int(num_nodes)
        self.source = "ids must fit int32" if num_nodes is None else num_nodes_source

    def expand(self, chunks):
        out = chunks | "Check" >> beam.ParDo(_ValidateChunk(self.limit, self.source)).with_outputs(
            "stats", "max_id", main="edges")
        return {"edges": out.edges, "max_id": out.max_id, "stats": out.stats}
