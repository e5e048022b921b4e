"""The task vocabulary: stage kinds, task kinds, schedule steps, lifecycle words and channels, and the
engine's message record (one task or result for one kind, epoch, stage, interval, partition, weight version).

Every enum is str-valued, so a member equals, hashes and formats as its word ("AV" == TaskKind.AV) and the wire
(Arrow metadata, JSON meta, topic names) stays readable by anything that knows nothing of this module.
Imports only numpy and the standard library.
"""
from __future__ import annotations

import dataclasses
from enum import Enum

import numpy as np

__all__ = ["Word", "StageKind", "TaskKind", "TENSOR_TASK_KINDS", "Step", "Lifecycle", "Direction", "Channel", "DATA_CHANNELS", "WireDtype",
           "Message", "copy_arrays", "freeze_arrays"]


class Word(str, Enum):
    """A str-valued enum member that prints as its value ("AV", not "TaskKind.AV")."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class StageKind(Word):
    """What one stage of a model does (`ops.models.Stage.kind`)."""

    GA = "GA"      # gather Â[i,:]·H (graph server; reads ghost columns)
    AV = "AV"      # apply vertex σ(AH·W) (tensor worker, row-local)
    AE = "AE"      # apply edge: attention over a block's in-edges (tensor worker)
    LOSS = "LOSS"  # logits, masked loss and its gradient (tensor worker, row-local)


class TaskKind(Word):
    """The kind of a task or of its result: the ``kind`` of an engine message and of a wire message."""

    GA = "GA"
    AV = "AV"
    SC = "SC"            # scatter ghost rows (graph server -> graph servers)
    AE = "AE"
    GA_BWD = "GA_BWD"    # ∇GA with Âᵀ
    AV_BWD = "AV_BWD"    # ∇AV
    SC_BWD = "SC_BWD"    # ∇SC: gradient partial sums back to the owners
    AE_BWD = "AE_BWD"    # ∇AE
    LAST = "LAST"        # fused last layer: AV + loss + ∇AV
    LOSS = "LOSS"        # loss + its gradient alone (the last stage is not an AV)
    WU = "WU"            # weight update (parameter server)
    GRAD = "GRAD"        # parameter gradients of one stage (tensor worker -> parameter server)
    WEIGHTS = "WEIGHTS"  # a weight version (parameter server -> everyone)
    WATERMARK = "WM"     # a producer finished (epoch, stage) on a ghost channel
    ERROR = "ERROR"      # a tensor task failed (the result that says so)
    CONTROL = "CTRL"     # the kind a control message carries on the wire
    WAIT = "WAIT"        # a timeline span: an interval waiting behind a gate (not a task that runs)


#: the tasks a tensor worker runs (a local pool or the Lambda handler)
TENSOR_TASK_KINDS = (TaskKind.AV, TaskKind.AE, TaskKind.LAST, TaskKind.LOSS, TaskKind.AV_BWD, TaskKind.AE_BWD)


class Step(Word):
    """One step of a graph server's per-interval schedule."""

    FORWARD = "F"   # a forward stage (GA on the graph server, AV/AE on a tensor worker)
    LAST = "LAST"   # the fused last layer
    LOSS = "LOSS"   # the loss alone
    BACKWARD = "B"  # a backward stage


class Direction(Word):
    """Which ghost channel a watermark is about."""

    FORWARD = "F"   # ghost rows (SC)
    BACKWARD = "B"  # ghost gradients (∇SC)


class StalenessMode(Word):
    """What an epoch reads stale under bounded staleness S >= 1 (README, 'Bounded staleness')."""

    SMOOTH = "smooth"     # weights e; an EMA of ghost values of epochs <= e - S (PipeGCN-GF); ghost gradients of e
    SMOOTH_ZERO = "smooth-zero"  # SMOOTH with the EMA started from 0, not bias-corrected (PipeGCN-GF's form)
    PREDICT = "predict"   # weights e; ghost values of e - S extrapolated to e; ghost gradients of e
    FRESH = "fresh"       # weights e; ghost values and ghost gradients of e - S (PipeGCN)
    STALE = "stale"       # weights e - S; ghost values and ghost gradients of e - S (delayed gradients)


class WireDtype(Word):
    """What a float32 row tensor is on the data channels (`pipelines.transports.wire`)."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"  # round-to-nearest-even bfloat16 bits: half the bytes, float32's exponent range

    @property
    def itemsize(self) -> int:
        return 4 if self is WireDtype.FLOAT32 else 2


class Lifecycle(Word):
    """Reports to the driver and commands from it (the kinds on the metrics and control channels)."""

    EPOCH = "EPOCH"            # a graph server finished an epoch (loss partial sums, statistics)
    DONE = "DONE"              # a graph server finished its last epoch
    FAILED = "FAILED"          # a role failed (the error is in meta)
    FINAL = "FINAL"            # a role's last report before it exits (statistics, transport counters)
    STOP = "STOP"              # driver -> roles: shut down
    STOP_AFTER = "STOP_AFTER"  # driver -> graph servers and parameter server: the last epoch is this one


#: control messages travel as the wire's ``control`` type
CONTROL_KINDS = (Lifecycle.STOP, Lifecycle.STOP_AFTER)


class Channel(Word):
    """Topic kinds: one channel per edge kind of the stage graph, partitioned by graph-server id."""

    TENSOR_TASKS = "tensor"        # graph server -> tensor workers (AV, AE, LAST, LOSS and their VJPs)
    TENSOR_RESULTS = "tensor.out"  # tensor workers -> graph server p
    GHOSTS = "ghosts"              # SC: graph server -> graph server q (forward ghost rows)
    GHOST_GRADS = "ghosts.grad"    # ∇SC: graph server -> owner partition (gradient partial sums)
    WATERMARKS = "watermarks"      # every producer -> consumers of its channel
    GRADS = "grads"                # tensor workers -> parameter server (dW for WU)
    WEIGHTS = "weights"            # parameter server -> everyone (new and retired versions)
    METRICS = "metrics"            # graph servers, parameter server -> driver
    CONTROL = "control"            # driver -> roles


#: the channels that carry per-row tensors between graph servers and tensor workers
DATA_CHANNELS = (Channel.TENSOR_TASKS, Channel.TENSOR_RESULTS, Channel.GHOSTS, Channel.GHOST_GRADS)


@dataclasses.dataclass(frozen=True, eq=False)
class Message:
    """kind: a TaskKind or Lifecycle word; stage: index in the model's stage list (-1 where none); arrays:
    named numpy arrays (the payload); meta: small JSON-able routing extras."""

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
