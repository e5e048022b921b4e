"""Split: the labels (collected in one worker) -> the seeded per-class train/val/test split as split codes."""
from __future__ import annotations

import numpy as np

import apache_beam as beam
from apache_beam import pvalue

from pipelines.beam.combiners import ConcatArrays
from pipelines.data.splits import per_class_split
from schemas.files import SPLIT_CODES, SPLIT_NAMES


def split_codes(columns, num_nodes: int, seed: int, train_per_class: int, val_per_class: int) -> np.ndarray:
    """int8 [N] split codes (:data:`schemas.files.SPLIT_CODES`) of ``per_class_split`` on (ids, labels)."""
    ids, labels = columns
    n = int(num_nodes)
    y = np.full(n, -1, np.int64)
    y[ids] = labels
    num_classes = int(y.max()) + 1 if (y >= 0).any() else 0
    codes = np.full(n, SPLIT_CODES["none"], np.int8)
    for name, mask in zip(SPLIT_NAMES, per_class_split(y, num_classes, train_per_class, val_per_class, seed)):
        codes[mask] = SPLIT_CODES[name]
    return codes


class Split(beam.PTransform):
    """{'labels': (partition, (ids, labels)), 'num_nodes'} -> one int8 vector [N] of split codes:
    ``train_per_class`` train and ``val_per_class`` val vertices of every class, the other labelled vertices test
    — the same seeded split as ``pipelines.data.splits.per_class_split`` (the labels are collected in one worker)."""

    def __init__(self, seed: int, train_per_class: int = 20, val_per_class: int = 30):
        super().__init__()
        self.seed, self.train, self.val = int(seed), int(train_per_class), int(val_per_class)

    def expand(self, inputs):
        return (
            inputs["labels"]
            | "Values" >> beam.Map(lambda kv: kv[1])
            | "Collect" >> beam.CombineGlobally(ConcatArrays((np.int64, np.int64)))
            | "PerClass" >> beam.Map(split_codes, num_nodes=pvalue.AsSingleton(inputs["num_nodes"]),
                                     seed=self.seed, train_per_class=self.train, val_per_class=self.val)
        )
