"""Combiners shared by the Beam pipelines: the stats channel (:class:`Stat`, :class:`StatsFn`) and ConcatArrays.

Every transform reports problems and counts as :class:`Stat` elements on a tagged output ``"stats"``; they are
merged by :class:`StatsFn` into one dict ``{name: [count, samples]}`` that the driver turns into errors and the
manifest's counters (written by :func:`pipelines.beam.writers.write_stats`). Stat names:

    name            count += n, keep up to SAMPLES samples
    "max:<name>"    maximum of n
    "list:<name>"   keep every sample (shard file records)
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

import apache_beam as beam
from apache_beam import pvalue

SAMPLES = 20                  # examples kept per counter (bad records, errors)


class Stat(NamedTuple):
    name: str
    n: int = 1
    sample: object = None


def stat_outputs(name: str, n: int, samples=()):
    """Tagged Stat outputs: the count, then up to SAMPLES samples (count 0 each)."""
    if n:
        yield pvalue.TaggedOutput("stats", Stat(name, int(n)))
    for s in list(samples)[:SAMPLES]:
        yield pvalue.TaggedOutput("stats", Stat(name, 0, s))


class StatsFn(beam.CombineFn):
    """Stat elements -> {name: [count, samples]} (see the module docstring for the name prefixes)."""

    def create_accumulator(self):
        return {}

    def add_input(self, acc, stat):
        name, n, sample = stat
        entry = acc.get(name)
        if name.startswith("max:"):
            acc[name] = [n if entry is None else max(entry[0], n), []]
            return acc
        if entry is None:
            entry = acc[name] = [0, []]
        entry[0] += n
        if sample is not None and (name.startswith("list:") or len(entry[1]) < SAMPLES):
            entry[1].append(sample)
        return acc

    def merge_accumulators(self, accs):
        out = {}
        for acc in accs:
            for name, (n, samples) in acc.items():
                entry = out.get(name)
                if entry is None:
                    out[name] = [n, list(samples)]
                elif name.startswith("max:"):
                    entry[0] = max(entry[0], n)
                else:
                    entry[0] += n
                    room = len(samples) if name.startswith("list:") else max(0, SAMPLES - len(entry[1]))
                    entry[1].extend(samples[:room])
        return out

    def extract_output(self, acc):
        for name, entry in acc.items():
            if not name.startswith("list:"):
                entry[1] = sorted(entry[1], key=str)[:SAMPLES]
        return acc


class ConcatArrays(beam.CombineFn):
    """Tuples of k numpy arrays -> one tuple of k concatenated arrays (for the steps that need a whole vector in
    one place: METIS, the per-class split, the degree vector)."""

    def __init__(self, dtypes: tuple):
        self.dtypes = tuple(np.dtype(d).str for d in dtypes)

    def create_accumulator(self):
        return [[] for _ in self.dtypes]

    def add_input(self, acc, row):
        for parts, a in zip(acc, row):
            parts.append(np.asarray(a))
        return acc

    def merge_accumulators(self, accs):
        out = self.create_accumulator()
        for acc in accs:
            for o, parts in zip(out, acc):
                o.extend(parts)
        return [[np.concatenate(o)] if len(o) > 1 else o for o in out]

    def extract_output(self, acc):
        return tuple(np.concatenate(parts).astype(dt, copy=False) if parts else np.zeros(0, dt)
                     for parts, dt in zip(acc, self.dtypes))
