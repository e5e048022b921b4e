"""The wire format of the data channels: float32 rows as they are, or narrowed to bfloat16 on every transport.

Issue 13's Kafka epoch is bound by bytes per epoch (kafka-python spends CPU per byte on both ends and one broker
on 2 cores carries what it carries). ``--wire-dtype bfloat16`` halves the row payloads of the four data
channels (tensor tasks, their results, ghost rows and ghost gradients): each float32 array of rank >= 2 travels
as the upper 16 bits of its round-to-nearest-even bfloat16 value (``ml_dtypes``, JAX's own bfloat16), stored as
``uint16`` and named in the message's ``meta["bf16"]``; the receiver widens it back to float32 before anyone
reads it. bfloat16 keeps float32's exponent range, so gradients of 1e-30 do not flush to zero as they would in
float16, and 8 significant bits (relative error <= 2^-8, between 2 and 3 decimal digits).

The narrowing sits in a transport wrapper, not in a codec, so the memory transport rounds exactly as Kafka does
and a run gives the same numbers on every transport. What stays float32: weights and weight gradients (the
parameter server's channels), rank-0/1 arrays (losses, counts, norms, CSR values) and every other channel.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from pipelines.transports.base import Consumer, Transport
from schemas.tasks import DATA_CHANNELS, Message, WireDtype

_DATA = frozenset(c.value for c in DATA_CHANNELS)
#: meta key listing the arrays of a message that travel as bfloat16 bits
NARROWED = "bf16"


def _narrowable(a) -> bool:
    return isinstance(a, np.ndarray) and a.dtype == np.float32 and a.ndim >= 2 and a.size > 0


def narrow(msg: Message) -> Message:
    """`msg` with its float32 arrays of rank >= 2 as bfloat16 bits (uint16), named in meta["bf16"]."""
    names = [k for k, a in msg.arrays.items() if _narrowable(a)]
    if not names:
        return msg
    arrays = dict(msg.arrays)
    for k in names:
        arrays[k] = np.ascontiguousarray(arrays[k]).astype(ml_dtypes.bfloat16).view(np.uint16)
    return msg.replace(arrays=arrays, meta={**msg.meta, NARROWED: sorted(names)})


def widen(msg: Message) -> Message:
    """The inverse of `narrow` up to rounding: the named arrays back as float32, the meta key gone."""
    names = msg.meta.get(NARROWED)
    if not names:
        return msg
    arrays = dict(msg.arrays)
    for k in names:
        arrays[k] = np.asarray(arrays[k], np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    meta = {k: v for k, v in msg.meta.items() if k != NARROWED}
    return msg.replace(arrays=arrays, meta=meta)


class NarrowedTransport(Transport):
    """`inner` with the data channels' row tensors narrowed on send and widened on poll; every other call and
    attribute is the inner transport's."""

    def __init__(self, inner: Transport):
        self.inner = inner

    def send(self, kind: str, partition: int, msg: Message) -> None:
        self.inner.send(kind, partition, narrow(msg) if str(kind) in _DATA else msg)

    def consumer(self, subscriptions, group=None) -> Consumer:
        return _WideningConsumer(self.inner.consumer(subscriptions, group))

    def flush(self, *args, **kw) -> None:
        self.inner.flush(*args, **kw)

    def close(self) -> None:
        self.inner.close()

    def stats(self) -> dict:
        return self.inner.stats()

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _WideningConsumer(Consumer):
    def __init__(self, inner: Consumer):
        self.inner = inner

    def poll(self, timeout: float, max_messages: int = 256) -> list[Message]:
        return [widen(m) for m in self.inner.poll(timeout, max_messages)]

    def commit(self) -> None:
        self.inner.commit()

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def with_wire_dtype(transport: Transport, wire_dtype: str | WireDtype) -> Transport:
    """`transport` itself for float32; wrapped in a `NarrowedTransport` for bfloat16 (once)."""
    if WireDtype(wire_dtype) is WireDtype.FLOAT32 or isinstance(transport, NarrowedTransport):
        return transport
    return NarrowedTransport(transport)
