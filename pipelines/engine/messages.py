"""The engine's errors and routing checks. The message record and the task vocabulary live in
`schemas.tasks` (the transports use them without importing the engine); the names below are kept for callers
that read them from here."""
from __future__ import annotations

from schemas.tasks import Channel, Message, copy_arrays, freeze_arrays  # noqa: F401

# Topic kinds by their former names (the members of `schemas.tasks.Channel`).
TENSOR_TASKS, TENSOR_RESULTS, GHOSTS, GHOST_GRADS, WATERMARKS, GRADS, WEIGHTS, METRICS, CONTROL = (
    Channel.TENSOR_TASKS, Channel.TENSOR_RESULTS, Channel.GHOSTS, Channel.GHOST_GRADS, Channel.WATERMARKS,
    Channel.GRADS, Channel.WEIGHTS, Channel.METRICS, Channel.CONTROL)
ALL_KINDS = tuple(Channel)


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
