"""The channel interface: send to (topic kind, partition), consume what was sent to a set of those."""
from __future__ import annotations

import abc
from schemas.tasks import Message



class TransportError(RuntimeError):
    """A transport cannot do its job: broker unreachable, a message over the size limit, a delivery that failed
    for good. The message is one line naming the channel and the cause."""


class Consumer(abc.ABC):
    @abc.abstractmethod
    def poll(self, timeout: float, max_messages: int = 256) -> list[Message]:
        """Messages available within `timeout` seconds, in the order each channel received them."""

    def commit(self) -> None:
        """Mark everything returned so far as processed (Kafka commits offsets; memory needs nothing)."""

    def close(self) -> None:
        pass


class Transport(abc.ABC):
    """Channels named (kind, partition). Every kind of the stage graph is one channel family (one Kafka topic),
    partitioned by graph-server id; `shared` consumers of a kind split its messages (a consumer group)."""

    @abc.abstractmethod
    def send(self, kind: str, partition: int, msg: Message) -> None: ...

    @abc.abstractmethod
    def consumer(self, subscriptions: list[tuple[str, int]], group: str | None = None) -> Consumer: ...

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def stats(self) -> dict:
        return {}
