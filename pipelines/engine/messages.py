"""The engine's message: one task or result for one (kind, epoch, stage, interval, partition, weight version)."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

# Topic kinds: one channel per edge kind of the stage graph, partitioned by graph-server id.
TENSOR_TASKS = "tensor"        # graph server -> tensor workers (AV, AE, LAST, LOSS and their VJPs)
TENSOR_RESULTS = "tensor.out"  # tensor workers -> graph server p
GHOSTS = "ghosts"              # SC: graph server -> graph server q (forward ghost rows)
GHOST_GRADS = "ghosts.grad"    # ∇SC: graph server -> owner partition (gradient partial sums)
WATERMARKS = "watermarks"      # every producer -> consumers of its channel
GRADS = "grads"                # tensor workers -> parameter server (dW for WU)
WEIGHTS = "weights"            # parameter server -> everyone (new and retired versions)
METRICS = "metrics"            # graph servers, parameter server -> driver
CONTROL = "control"            # driver -> roles

ALL_KINDS = (TENSOR_TASKS, TENSOR_RESULTS, GHOSTS, GHOST_GRADS, WATERMARKS, GRADS, WEIGHTS, METRICS, CONTROL)


@dataclasses.dataclass(frozen=True, eq=False)
class Message:
    """kind: the task or event ("AV", "LAST", "AV_BWD", "SC", "WM", "WU", ...); stage: index in the model's stage
    list (-1 where none); arrays: named numpy arrays (the payload); meta: small JSON-able routing extras."""

    kind: str
    epoch: int
    stage: int
    interval: int
    partition: int
    version: int
    arrays: dict = dataclasses.field(default_factory=dict)
    meta: dict = dataclasses.field(default_factory=dict)

    @property
    def key(self) -> tuple:
        """Identity of the task a message belongs to: duplicates (relaunched stragglers) share it."""
        return (self.kind, self.epoch, self.stage, self.interval, self.partition)

    def nbytes(self) -> int:
        return int(sum(np.asarray(a).nbytes for a in self.arrays.values()))

    def replace(self, **kw) -> "Message":
        return dataclasses.replace(self, **kw)


def copy_arrays(msg: Message) -> Message:
    """A deep copy of the payload, so no two roles ever share a mutable buffer."""
    return msg.replace(arrays={k: np.array(v, copy=True) for k, v in msg.arrays.items()}, meta=dict(msg.meta))


def freeze_arrays(msg: Message) -> Message:
    """Read-only views of the payload: the receiver can read the sender's buffers but never write them."""
    frozen = {}
    for k, v in msg.arrays.items():
        v = np.asarray(v).view()
        v.flags.writeable = False
        frozen[k] = v
    return msg.replace(arrays=frozen, meta=dict(msg.meta))


class EngineError(RuntimeError):
    """The engine met something that must not happen (an unknown interval, a weight version that does not exist)."""


def check_routing(msg: Message, num_partitions: int, num_intervals: int, num_stages: int) -> None:
    """Reject a message whose routing fields name nothing this run has."""
    if not 0 <= msg.partition < num_partitions:
        raise EngineError(f"message {msg.kind} for unknown partition {msg.partition} "
                          f"(this run has {num_partitions})")
    if msg.interval != -1 and not 0 <= msg.interval < num_intervals:
        raise EngineError(f"message {msg.kind} for unknown interval {msg.interval} "
                          f"(partition {msg.partition} has {num_intervals})")
    if msg.stage != -1 and not 0 <= msg.stage < num_stages:
        raise EngineError(f"message {msg.kind} for unknown stage {msg.stage} (the model has {num_stages})")
