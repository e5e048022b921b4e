"""The Kafka transport: the engine's channels as Kafka topics, messages as Arrow IPC streams (kafka-python).

Topics
------
One topic per run and channel kind: ``dorylus.<run_id>.<kind>`` (``dorylus.<run_id>.tensor``,
``.tensor.out``, ``.ghosts``, ``.ghosts.grad``, ``.watermarks``, ``.grads``, ``.weights``, ``.metrics``,
``.control``) plus ``dorylus.<run_id>.dead-letter``. Kafka partition = engine channel partition = graph-server
id: the channels a graph server sends to or reads from (``tensor``, ``tensor.out``, ``ghosts``, ``ghosts.grad``,
``watermarks``) have P partitions; ``control`` has P + 1 (partition P addresses the tensor workers); ``grads``,
``weights``, ``metrics`` and ``dead-letter`` have one. The engine's tensor-task channel is one logical channel (a
work queue: graph servers send every task to channel 0); its topic has P partitions and a task goes to the
partition of the graph server that sent it, so tensor-worker processes split the graph servers between them:
worker k of W reads the partitions p with p mod W = k (``work_share``). A resumed run writes to fresh topics:
its run id is the first one's plus ``-r<n>`` (see `pipelines.launch`). Record keys are the interval (decimal ASCII, ``-1`` where
none) and headers name the task (``dorylus.kind``, ``.epoch``, ``.stage``, ``.interval``); values are Arrow IPC
streams (`pipelines.transports.codec`) that any Arrow reader decodes.

Replication
-----------
On a cluster of three or more brokers (``describe_cluster`` at topic creation) the run's topics get replication
factor 3 and ``min.insync.replicas=2``: with ``acks=all`` a message is acknowledged once two replicas hold it, so
the loss of any one broker (its partitions' leadership moves to an in-sync replica) loses nothing and writes go
on. On one or two brokers, replication factor 1 (``replication_factor`` overrides).

Delivery
--------
Producer: ``acks=all``, idempotent, unbounded retries within ``delivery_timeout_ms``, so a broker restart or a
leader change loses and duplicates nothing; a delivery that finally fails makes the next ``send``/``flush``
raise. Broker loss: with ``broker_timeout_s`` set, a watch thread asks the cluster for its metadata every few
seconds; when no broker has answered for that long, the transport fails (``send``, ``flush`` and every
consumer's ``poll`` raise a `TransportError` naming the client), so a role cut off from the brokers fails
instead of waiting forever; shorter outages only delay it (deliveries are retried for ``broker_timeout_s`` plus
a request timeout). Consumers commit
offsets only in ``commit()``, which the engine calls after it has handled a poll's messages (at-least-once; the
engine discards duplicates). A group that reads only the tensor-task channel (the tensor workers) is one Kafka
consumer per process, shared by the pool's threads; every reader assigns itself its partitions. No reader uses
Kafka's group membership (subscribe/rebalance): kafka-python 3.0 can drop an assignment that a rebalance
completes between two short polls, leaving a member idle until its session expires, and a static share is all
a run with a fixed set of processes needs (a process that dies fails the run; ``--resume`` restarts it). Values that do not decode (corrupt bytes, a schema that is not the engine's, another run's
message) go to the dead-letter topic with the reason in the headers and are counted, never handed to the engine.

Security
--------
Every client (producer, consumers, admin) takes the TLS/SASL settings of the environment, the variables the
Terraform deployment sets (``DORYLUS_KAFKA_AUTH`` = ``scram`` or ``iam`` for MSK, ``DORYLUS_KAFKA_SECRET_ARN``,
...): see `pipelines.transports.kafka_security`. Role processes launched by ``--spawn-local`` inherit them.

Bytes
-----
On the tensor-task topic an array the sender already sent on the same partition travels as a reference (a
content key in the value's meta, ``wire.blobs``; `pipelines.transports.blobs`), so such a value is valid Arrow
but complete only for a reader that read the partition from its start. Streams whose values do not compress
are sent without lz4 (probed again every `COMPRESSION_PROBE_EVERY` messages). Consumers read through a thread
each (`pipelines.transports.kafka_readers`).

Sizes
-----
Messages are refused before sending when the encoded value exceeds ``max_message_bytes`` (default 64 MiB, the
broker's ``message.max.bytes`` in infra/local; topics are created with ``max.message.bytes`` set to it), with an
error that names the message and suggests more intervals. The producer's ``max_request_size`` is that limit plus
record overhead; consumers fetch up to ``max_partition_fetch_bytes`` = 8 MiB per partition and ``fetch_max_bytes``
= the limit + 1 MiB per request (Kafka returns a larger single message anyway, so nothing ever stalls).
"""
from __future__ import annotations

import collections
import logging
import re
import sys
import threading
import time

from pipelines.transports import blobs, codec
from pipelines.transports.base import Consumer, Transport, TransportError
from pipelines.transports.kafka_readers import AssignedConsumer, MemberConsumer, SharedGroup, transient_errors
from pipelines.transports.kafka_security import client_settings, describe
from schemas.tasks import Channel, Message

DEAD_LETTER = "dead-letter"
SINGLE_PARTITION = (Channel.GRADS, Channel.WEIGHTS, Channel.METRICS)
#: kinds read by work-sharing groups (each process its static share of the partitions, see ``work_share``).
#: Their one engine channel spreads over P Kafka partitions, by the sending graph server.
BALANCED_KINDS = (Channel.TENSOR_TASKS,)
#: kinds whose repeated arrays are sent once per partition (`pipelines.transports.blobs`): the tensor tasks,
#: whose backward tasks carry their forward inputs again and whose first layer reads the same rows every epoch
DEDUPED_KINDS = (Channel.TENSOR_TASKS,)
DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20
DEFAULT_BROKER_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_MS = 30000
#: the clients refresh topic metadata at least this often (kafka-python's default, 300 s, is as long as the
#: driver's stall timeout: a client left with stale metadata of a run's fresh topics would sit it out)
METADATA_MAX_AGE_MS = 10000
REPLICATED_MIN_BROKERS = 3            # clusters this large get replicated run topics
REPLICATION_FACTOR = 3
MIN_INSYNC_REPLICAS = 2
RECORD_OVERHEAD = 64 * 2**10          # room for the record batch header, key and headers
COMPRESS_MIN_BYTES = 16 * 2**10       # smaller payloads are sent uncompressed
#: a stream (channel, message kind, stage) whose compressed values keep more than this share of their payload
#: is sent uncompressed for the next COMPRESSION_PROBE_EVERY messages
INCOMPRESSIBLE = 0.9
COMPRESSION_PROBE_EVERY = 32
#: consumers: the broker holds a fetch until a record arrives or this long passes (an idle consumer's fetch
#: rounds cost it and the broker CPU; a record that lands is returned at once either way)
FETCH_MAX_WAIT_MS = 500
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,150}$")

log = logging.getLogger(__name__)


def topic_name(run_id: str, kind: str) -> str:
    return f"dorylus.{run_id}.{kind}"


def topic_partitions(kind: str, partitions: int) -> int:
    """Kafka partitions of a channel kind in a run with `partitions` graph servers."""
    if kind in SINGLE_PARTITION or kind == DEAD_LETTER:
        return 1
    if kind == Channel.CONTROL:
        return partitions + 1
    return partitions


def channel_partitions(kind: str, partitions: int) -> int:
    """Engine channels of a kind (the partitions `send` and `consumer` name)."""
    return 1 if kind in BALANCED_KINDS else topic_partitions(kind, partitions)


def worker_control_partition(partitions: int) -> int:
    """The control partition the tensor workers read (graph server p reads partition p)."""
    return partitions


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID_RE.match(run_id):
        raise TransportError(f"run id {run_id!r} must be 1-151 letters, digits, '_', '.' or '-' (it names topics)")
    return run_id


def _import_kafka():
    try:
        import kafka  # noqa: F401
    except ImportError:  # pragma: no cover
        raise TransportError("the kafka transport needs kafka-python (pip install 'dorylus[kafka]')") from None
    return kafka


def check_broker(bootstrap: str | None, timeout_s: float = 10.0, keep: bool = False, security: dict | None = None):
    """Raise TransportError (one line) unless a Kafka broker answers at `bootstrap` within `timeout_s`.
    keep: return the connected admin client (else it is closed). security: kafka-python TLS/SASL settings
    (default: `kafka_security.client_settings()` of the environment)."""
    if not bootstrap:
        raise TransportError("the kafka transport needs --bootstrap HOST:PORT")
    kafka = _import_kafka()
    security = client_settings() if security is None else security
    t0 = time.monotonic()
    try:
        admin = kafka.KafkaAdminClient(bootstrap_servers=bootstrap, bootstrap_timeout_ms=int(timeout_s * 1000),
                                       request_timeout_ms=int(timeout_s * 1000), client_id="dorylus-check",
                                       **security)
    except Exception as e:  # KafkaTimeoutError, NoBrokersAvailable, socket errors, bad host strings, auth
        raise TransportError(f"Kafka broker at {bootstrap} is unreachable over {describe(security)} (gave up "
                             f"after {time.monotonic() - t0:.0f}s: {type(e).__name__}: {e})") from None
    if keep:
        return admin
    admin.close()
    return None


def admin_call(fn, *args, timeout_s: float = 30.0, **kw):
    """Call a kafka-python admin method, again while the broker it picked is out of reach: with one broker of a
    cluster down, a request sent there fails at once, and the next attempt picks another broker (the failed one
    is in reconnect backoff)."""
    transient = transient_errors() + (_import_kafka().errors.NotControllerError,)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return fn(*args, **kw)
        except transient:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


def cluster_replication(admin) -> tuple[int, dict]:
    """Replication factor and topic configs for new run topics on the cluster `admin` talks to: 3 replicas and
    ``min.insync.replicas=2`` on 3+ brokers, else 1 replica."""
    brokers = len(admin_call(admin.describe_cluster).get("brokers") or [])
    if brokers >= REPLICATED_MIN_BROKERS:
        return REPLICATION_FACTOR, {"min.insync.replicas": str(MIN_INSYNC_REPLICAS)}
    return 1, {}


class KafkaTransport(Transport):
    """Channels (kind, partition) of one run as Kafka topic partitions; see the module docstring.

    dedupe: send the tensor tasks' repeated arrays once per partition (`pipelines.transports.blobs`).
    linger_consumers: `Consumer.close()` keeps the Kafka consumer until `drain()`/`close()` of the transport,
    so a role process can read its channels to their end before it exits (exact message accounting).
    replication_factor: None (default) picks it from the cluster's size (`cluster_replication`).
    broker_timeout_s: fail when no broker has answered for this long (None: never); delivery_timeout_s
    (default: broker_timeout_s plus a request timeout, or 600 s) bounds each message's retries.
    """

    def __init__(self, bootstrap: str, run_id: str, partitions: int, *, compression: str | None = "lz4",
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, connect_timeout_s: float = 10.0,
                 create_topics: bool = True, replication_factor: int | None = None, client_id: str = "dorylus",
                 linger_consumers: bool = False, commit_interval_s: float = 0.5,
                 delivery_timeout_s: float | None = None, work_share: tuple[int, int] = (0, 1),
                 security: dict | None = None, broker_timeout_s: float | None = DEFAULT_BROKER_TIMEOUT_S,
                 dedupe: bool = True):
        kafka = _import_kafka()
        self.bootstrap = bootstrap
        self.run_id = check_run_id(run_id)
        self.partitions = int(partitions)
        self.compression = compression
        self.max_message_bytes = int(max_message_bytes)
        self.replication_factor = replication_factor
        self.client_id = client_id
        self.linger_consumers = linger_consumers
        self.commit_interval_s = commit_interval_s
        self.connect_timeout_s = connect_timeout_s
        k, w = (int(v) for v in work_share)
        if not (w >= 1 and 0 <= k < w):
            raise TransportError(f"work share {k} of {w}: need 0 <= member < members")
        self.work_share = (k, w)
        self.security = client_settings() if security is None else dict(security)
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._lost: TransportError | None = None  # set by the broker watch: every poll raises it
        self._sent = collections.Counter()       # (kind, p) -> sends issued
        self._acked = collections.Counter()      # (kind, p) -> sends the broker acknowledged
        self._acked_bytes = collections.Counter()  # kind -> value bytes acknowledged
        self._payload_bytes = collections.Counter()  # kind -> array bytes (before encoding) acknowledged
        self._failed = collections.Counter()     # (kind, p) -> deliveries that failed for good
        self._consumed = collections.Counter()   # (kind, p, group) -> distinct messages handed to the engine
        self._redelivered = collections.Counter()  # (kind, p, group) -> messages handed over again
        self._high: dict = {}                    # (topic, p, group) -> offset after the highest delivered
        self._dl_reader = None
        self._dead = collections.Counter()       # (kind, p) -> values sent to the dead-letter topic
        self._dead_reasons: list[str] = []
        self._consumers: list = []
        self._shared: dict[str, SharedGroup] = {}
        self._blobs = blobs.SenderBlobs() if dedupe else None  # arrays each tensor-task partition's reader holds
        self._blob_lock = threading.Lock()
        self._skip_compression: collections.Counter = collections.Counter()  # stream -> uncompressed sends left
        self._read_blobs = blobs.ReaderBlobs()
        if broker_timeout_s is not None and broker_timeout_s <= 0:
            raise TransportError(f"broker timeout must be > 0 seconds, got {broker_timeout_s}")
        self.broker_timeout_s = broker_timeout_s
        if delivery_timeout_s is None:
            delivery_timeout_s = 600.0 if broker_timeout_s is None else broker_timeout_s + REQUEST_TIMEOUT_MS / 1000
        admin = check_broker(bootstrap, connect_timeout_s, keep=True, security=self.security)
        try:
            if create_topics:
                self.ensure_topics(admin=admin)
        except BaseException:
            admin.close()
            raise
        self._closing = threading.Event()
        self._watch = None
        if broker_timeout_s is None:
            admin.close()
        else:
            self._watch = threading.Thread(target=self._watch_brokers, args=(admin,), daemon=True,
                                           name="kafka-broker-watch")
            self._watch.start()
        self._producer = kafka.KafkaProducer(
            bootstrap_servers=bootstrap, client_id=f"{client_id}-producer", acks="all", enable_idempotence=True,
            retries=float("inf"), max_in_flight_requests_per_connection=5, linger_ms=0,
            batch_size=256 * 2**10, max_request_size=self.max_message_bytes + RECORD_OVERHEAD,
            request_timeout_ms=REQUEST_TIMEOUT_MS, delivery_timeout_ms=int(delivery_timeout_s * 1000),
            metadata_max_age_ms=METADATA_MAX_AGE_MS,
            max_block_ms=int(delivery_timeout_s * 1000), reconnect_backoff_max_ms=1000,
            bootstrap_timeout_ms=int(connect_timeout_s * 1000), **self.security)

    # ---------------------------------------------------------------------------------------------- brokers
    def _watch_brokers(self, admin) -> None:
        """Fail the transport when no broker has answered a metadata request for `broker_timeout_s`."""
        every = min(2.0, self.broker_timeout_s / 4)
        last_ok, last_err = time.monotonic(), None
        try:
            while not self._closing.wait(every):
                try:
                    admin.describe_cluster()
                    last_ok = time.monotonic()
                except Exception as e:  # connection refused, timeouts: the brokers are out of reach
                    last_err = e
                away = time.monotonic() - last_ok
                if away > self.broker_timeout_s and not self._closing.is_set():
                    why = str(last_err) or type(last_err).__name__
                    self._lost = TransportError(
                        f"{self.client_id} lost the Kafka brokers at {self.bootstrap}: no answer for {away:.0f}s "
                        f"(broker timeout {self.broker_timeout_s:g}s; last error: {why})")
                    with self._lock:
                        if self._error is None:
                            self._error = self._lost
                    print(f"dorylus: {self._lost}", file=sys.stderr, flush=True)
                    return
        finally:
            try:
                admin.close()
            except Exception as e:  # closing a client of unreachable brokers
                log.info("broker watch close: %s", e)

    def _raise_if_lost(self) -> None:
        if self._lost is not None:
            raise self._lost

    # ---------------------------------------------------------------------------------------------- topics
    def topic(self, kind: str) -> str:
        return topic_name(self.run_id, kind)

    def topic_partitions(self, kind: str) -> int:
        return topic_partitions(kind, self.partitions)

    def kinds(self) -> list[str]:
        return [*tuple(Channel), DEAD_LETTER]

    def ensure_topics(self, timeout_s: float = 60.0, admin=None) -> None:
        """Create the run's topics (idempotent: several processes may race to create them)."""
        kafka = _import_kafka()
        own = admin is None
        if own:
            admin = kafka.KafkaAdminClient(bootstrap_servers=self.bootstrap, client_id=f"{self.client_id}-admin",
                                           bootstrap_timeout_ms=int(self.connect_timeout_s * 1000),
                                           **self.security)
        try:
            want = {self.topic(k): topic_partitions(k, self.partitions) for k in self.kinds()}
            rf, configs = cluster_replication(admin)
            if self.replication_factor is not None:
                rf, configs = self.replication_factor, {}
            spec = {name: {"num_partitions": n, "replication_factor": rf,
                           "configs": {"max.message.bytes": str(self.max_message_bytes), **configs}}
                    for name, n in want.items()}
            resp = admin_call(admin.create_topics, spec, raise_errors=False)
            for t in resp.get("topics", []):
                if t["error_code"] not in (0, 36):  # 36: TOPIC_ALREADY_EXISTS
                    raise TransportError(f"cannot create topic {t['name']}: {t.get('error_message')} "
                                         f"(error {t['error_code']})")
            admin_call(admin.wait_for_topics, list(want), timeout_ms=int(timeout_s * 1000))
            for desc in admin_call(admin.describe_topics, list(want)):
                have = len(desc.get("partitions", []))
                if have < want[desc["name"]]:
                    raise TransportError(f"topic {desc['name']} has {have} partitions, this run needs "
                                         f"{want[desc['name']]} (a run id reused with more partitions?)")
        finally:
            if own:
                admin.close()

    # ---------------------------------------------------------------------------------------------- sending
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def send(self, kind: str, partition: int, msg: Message) -> None:
        self._raise_if_failed()
        if not 0 <= partition < channel_partitions(kind, self.partitions):
            raise TransportError(f"channel {kind}[{partition}] does not exist in a run with {self.partitions} "
                                 f"graph servers")
        if kind in BALANCED_KINDS:  # one work queue, spread over the topic's partitions by graph server
            partition = msg.partition % topic_partitions(kind, self.partitions)
        if self._blobs is None or kind not in DEDUPED_KINDS:
            self._send(kind, partition, msg, msg.nbytes())
            return
        channel = (kind, partition)
        with self._blob_lock:  # one partition's table operations in the order its records are produced
            arrays, ops, nbytes = self._blobs.plan(channel, msg.arrays)
            wire = msg if not ops else msg.replace(arrays=arrays, meta={**msg.meta, blobs.META_KEY: ops})
            self._send(kind, partition, wire, nbytes, label=msg)
            self._blobs.commit(channel, msg.arrays, ops)

    def _send(self, kind: str, partition: int, msg: Message, nbytes: int, label: Message | None = None) -> None:
        label = label or msg
        comp = self.compression if nbytes >= COMPRESS_MIN_BYTES else None
        stream = (kind, msg.kind, msg.stage)
        skipped = comp is not None and self._skip_compression.get(stream, 0) > 0
        if skipped:
            self._skip_compression[stream] -= 1
        value = memoryview(codec.encode_buffer(msg, self.run_id, None if skipped else comp))  # bytes-likes
        if skipped and len(value) > self.max_message_bytes - RECORD_OVERHEAD:
            # a stream judged incompressible may still carry a message that fits only compressed
            value, skipped = memoryview(codec.encode_buffer(msg, self.run_id, comp)), False
        if comp is not None and not skipped and len(value) > INCOMPRESSIBLE * nbytes:
            # dense float rows (ghost values, activations) do not compress: compressing them only costs CPU on
            # both ends (and time on the critical path); probe again now and then
            self._skip_compression[stream] = COMPRESSION_PROBE_EVERY
        if len(value) > self.max_message_bytes - RECORD_OVERHEAD:
            raise TransportError(
                f"{label.kind} message for {kind}[{partition}] (epoch {label.epoch}, stage {label.stage}, interval "
                f"{label.interval}) is {len(value) / 2**20:.1f} MiB encoded, over the Kafka message limit of "
                f"{(self.max_message_bytes - RECORD_OVERHEAD) / 2**20:.1f} MiB (broker message.max.bytes); "
                f"use more intervals so blocks are smaller")
        headers = [("dorylus.kind", msg.kind.encode()), ("dorylus.epoch", str(msg.epoch).encode()),
                   ("dorylus.stage", str(msg.stage).encode()), ("dorylus.interval", str(msg.interval).encode())]
        with self._lock:
            self._sent[(kind, partition)] += 1
        fut = self._producer.send(self.topic(kind), value=value, key=str(msg.interval).encode(), headers=headers,
                                  partition=partition)
        fut.add_callback(self._on_ack, kind, partition, len(value), nbytes)
        fut.add_errback(self._on_fail, kind, partition, msg.kind)

    def _on_ack(self, kind, partition, size, nbytes, _meta):
        with self._lock:
            self._acked[(kind, partition)] += 1
            self._acked_bytes[kind] += size
            self._payload_bytes[kind] += nbytes

    def _on_fail(self, kind, partition, what, exc):
        with self._lock:
            self._failed[(kind, partition)] += 1
            if self._error is None:
                self._error = TransportError(f"delivery of a {what} message to {self.topic(kind)}[{partition}] "
                                             f"failed: {type(exc).__name__}: {exc}")

    def flush(self, timeout_s: float | None = None) -> None:
        self._raise_if_lost()  # nothing can be delivered: waiting would only delay the failure
        self._producer.flush(timeout=timeout_s)
        self._raise_if_failed()

    # ---------------------------------------------------------------------------------------------- receiving
    def consumer(self, subscriptions, group=None) -> Consumer:
        subs = [(k, int(p)) for k, p in subscriptions]
        for k, p in subs:
            if k not in tuple(Channel):
                raise TransportError(f"unknown channel kind {k!r}")
            if not 0 <= p < channel_partitions(k, self.partitions):
                raise TransportError(f"channel {k}[{p}] does not exist in a run with {self.partitions} "
                                     f"graph servers")
        balanced = [k for k, _ in subs if k in BALANCED_KINDS]
        if balanced and (len(balanced) != len(subs) or group is None):
            raise TransportError(f"the {BALANCED_KINDS} channels are work queues: read them alone, in a group")
        if balanced:
            with self._lock:
                shared = self._shared.get(group)
                if shared is None:
                    shared = self._shared[group] = SharedGroup(self, sorted({k for k, _ in subs}), group)
            c = MemberConsumer(shared)
        else:
            c = AssignedConsumer(self, subs, group)
        with self._lock:
            self._consumers.append(c)
        return c

    def _new_kafka_consumer(self, group: str | None):
        kafka = _import_kafka()
        return kafka.KafkaConsumer(
            bootstrap_servers=self.bootstrap, client_id=f"{self.client_id}-{group or 'anon'}",
            group_id=None if group is None else f"dorylus.{self.run_id}.{group}",
            enable_auto_commit=False, auto_offset_reset="earliest",
            fetch_min_bytes=1, fetch_max_wait_ms=FETCH_MAX_WAIT_MS, max_partition_fetch_bytes=8 * 2**20,
            fetch_max_bytes=self.max_message_bytes + 2**20,
            receive_message_max_bytes=2 * self.max_message_bytes + 2**20,
            request_timeout_ms=30000, reconnect_backoff_max_ms=1000, session_timeout_ms=30000,
            heartbeat_interval_ms=3000, max_poll_interval_ms=600000, metadata_max_age_ms=METADATA_MAX_AGE_MS,
            bootstrap_timeout_ms=int(self.connect_timeout_s * 1000), **self.security)

    def _kind_of(self, topic: str) -> str:
        prefix = f"dorylus.{self.run_id}."
        return topic[len(prefix):] if topic.startswith(prefix) else topic

    def decode_records(self, records, group: str | None) -> list[Message]:
        """Decode polled records (the receive path, public so records can be fed without a broker); undecodable
        ones go to the dead-letter topic."""
        return [m for m in (self.decode_record(rec, group) for rec in records) if m is not None]

    def decode_record(self, rec, group: str | None) -> Message | None:
        """One polled record's message (also when it is read again after a reconnect: the engine discards
        duplicates); None for a value that does not decode (it goes to the dead-letter topic)."""
        g = group or "-"
        kind = self._kind_of(rec.topic)
        key = (rec.topic, rec.partition, g)
        with self._lock:
            again = rec.offset < self._high.get(key, 0)
            self._high[key] = max(self._high.get(key, 0), rec.offset + 1)
            if again:  # read again from the last commit (a reconnect): the engine discards the duplicates
                self._redelivered[(kind, rec.partition, g)] += 1
        try:
            if rec.value is None:
                raise codec.SchemaError("empty value (a tombstone)")
            msg = codec.decode(rec.value, self.run_id)
            ops = msg.meta.get(blobs.META_KEY)
            if ops is not None:
                arrays = self._read_blobs.resolve((rec.topic, rec.partition, g), msg.arrays, ops, replay=again)
                meta = {k: v for k, v in msg.meta.items() if k != blobs.META_KEY}
                msg = msg.replace(arrays=arrays, meta=meta)
        except Exception as e:  # anything a foreign or corrupt value can raise
            if not again:
                self._dead_letter(rec, kind, group, f"{type(e).__name__}: {e}")
            return None
        if not again:
            with self._lock:
                self._consumed[(kind, rec.partition, g)] += 1
        return msg

    def _dead_letter(self, rec, kind: str, group: str | None, reason: str) -> None:
        reason = reason[:2000]
        headers = [("dorylus.error", reason.encode()), ("dorylus.source.topic", rec.topic.encode()),
                   ("dorylus.source.partition", str(rec.partition).encode()),
                   ("dorylus.source.offset", str(rec.offset).encode()),
                   ("dorylus.group", (group or "-").encode())]
        with self._lock:
            self._dead[(kind, rec.partition)] += 1
            self._dead_reasons.append(f"{rec.topic}[{rec.partition}]@{rec.offset}: {reason}")
            del self._dead_reasons[:-20]
        print(f"dorylus: dead letter: {rec.topic}[{rec.partition}]@{rec.offset} ({group}): {reason}",
              file=sys.stderr, flush=True)
        try:
            value = rec.value if rec.value is not None else b""
            self._producer.send(self.topic(DEAD_LETTER), value=value, key=rec.key, headers=headers, partition=0)
        except Exception as e:  # the count and the log line above still record it
            log.warning("could not write a dead letter: %s", e)

    # ---------------------------------------------------------------------------------------------- lifecycle
    def drain(self, timeout_s: float = 60.0) -> None:
        """Read every (lingering) consumer's partitions to their current end, then commit.

        For a role about to exit once nothing upstream produces any more: whatever is left (duplicates of
        relaunched tasks, a last watermark) is consumed and dropped, so that per channel the messages
        consumed equal the messages produced."""
        deadline = time.monotonic() + timeout_s
        for c in list(self._consumers):
            c._drain(deadline)
        for g in list(self._shared.values()):
            g.drain(deadline)

    def close(self) -> None:
        self._closing.set()
        for c in list(self._consumers):
            c._close_now()
        for g in list(self._shared.values()):
            g.close()
        if self._dl_reader is not None:
            self._dl_reader.close()
        try:
            if self._lost is None:
                self._producer.flush(timeout=60)
        finally:
            self._producer.close(timeout=0 if self._lost is not None else 10)

    def dead_letter_count(self, timeout_s: float = 5.0) -> int | None:
        """Messages in this run's dead-letter topic, written by any process (None if the broker does not
        answer within `timeout_s`)."""
        kafka = _import_kafka()
        try:
            if self._dl_reader is None:
                self._dl_reader = kafka.KafkaConsumer(bootstrap_servers=self.bootstrap,
                                                      client_id=f"{self.client_id}-dl",
                                                      metadata_max_age_ms=METADATA_MAX_AGE_MS,
                                                      bootstrap_timeout_ms=int(self.connect_timeout_s * 1000),
                                                      **self.security)
            tp = kafka.TopicPartition(self.topic(DEAD_LETTER), 0)
            return int(self._dl_reader.end_offsets([tp], timeout_ms=int(timeout_s * 1000))[tp])
        except kafka.errors.KafkaError:
            # A reader that lived through a broker restart kept timing out on every later call (each epoch row
            # then waited the whole timeout and lost its count); the next call builds a fresh one.
            reader, self._dl_reader = self._dl_reader, None
            if reader is not None:
                reader.close()
            return None

    def stats(self) -> dict:
        """Per kind: messages and value bytes the broker acknowledged; per channel (``kind/partition``): messages
        produced (acknowledged) and consumed by each group (distinct offsets; ``redelivered`` counts those handed
        over again after a reconnect); dead letters and failed deliveries."""
        with self._lock:
            channels: dict[str, dict] = {}
            for (kind, p), n in self._acked.items():
                channels.setdefault(f"{kind}/{p}", {"produced": 0, "consumed": {}})["produced"] = n
            for (kind, p, g), n in self._consumed.items():
                channels.setdefault(f"{kind}/{p}", {"produced": 0, "consumed": {}})["consumed"][g] = n
            for (kind, p, g), n in self._redelivered.items():
                channels.setdefault(f"{kind}/{p}", {"produced": 0, "consumed": {}}).setdefault(
                    "redelivered", {})[g] = n
            messages = collections.Counter()
            for (kind, p), n in self._acked.items():
                messages[kind] += n
            return {
                "transport": "kafka",
                "messages": dict(messages),
                "bytes": dict(self._acked_bytes),
                "payload_bytes": dict(self._payload_bytes),
                "deduplicated_bytes": self._deduplicated(),
                "channels": channels,
                "dead_letters": {f"{k}/{p}": n for (k, p), n in self._dead.items()},
                "dead_letter_reasons": list(self._dead_reasons),
                "failed_deliveries": {f"{k}/{p}": n for (k, p), n in self._failed.items()},
                "unacknowledged": sum(self._sent.values()) - sum(self._acked.values()) - sum(self._failed.values()),
            }

    def _deduplicated(self) -> dict:
        """Per kind: array bytes sent as references to arrays the reader already had (not in payload_bytes)."""
        out = collections.Counter()
        if self._blobs is not None:
            with self._blob_lock:
                for (kind, _), n in self._blobs.saved_bytes.items():
                    out[kind] += n
        return dict(out)

    def offsets(self) -> dict:
        """The offsets each consumer group of this process has processed: {group: {"topic/partition": offset}}."""
        out: dict = {}
        for c in list(self._consumers):
            if isinstance(c, AssignedConsumer):
                out.setdefault(c.group or "-", {}).update(c.processed_offsets())
        for g in list(self._shared.values()):
            out.setdefault(g.group, {}).update(g.processed_offsets())
        return out


def merge_stats(parts: list[dict]) -> dict:
    """Sum the transport stats of several processes (each counts what it produced and consumed)."""
    summed = ("messages", "bytes", "payload_bytes", "deduplicated_bytes", "dead_letters", "failed_deliveries")
    out = {"transport": "kafka", **{k: collections.Counter() for k in summed}, "channels": {},
           "dead_letter_reasons": [], "unacknowledged": 0}
    for s in parts:
        if not s:
            continue
        for key in summed:
            out[key].update(s.get(key, {}))
        out["unacknowledged"] += int(s.get("unacknowledged", 0))
        out["dead_letter_reasons"] += s.get("dead_letter_reasons", [])
        for ch, v in s.get("channels", {}).items():
            c = out["channels"].setdefault(ch, {"produced": 0, "consumed": {}})
            c["produced"] += v.get("produced", 0)
            for g, n in v.get("consumed", {}).items():
                c["consumed"][g] = c["consumed"].get(g, 0) + n
            for g, n in v.get("redelivered", {}).items():
                c.setdefault("redelivered", {})[g] = c.get("redelivered", {}).get(g, 0) + n
    for key in summed:
        out[key] = dict(out[key])
    out["dead_letter_total"] = sum(out["dead_letters"].values())
    return out
