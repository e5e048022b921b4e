"""A real Kafka broker for the tests that need one.

Use in a test module::

    from tests.kafka_fixtures import kafka_bootstrap, restart_broker  # noqa: F401  (pytest fixture)

    pytestmark = pytest.mark.kafka

    def test_something(kafka_bootstrap):
        producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)

``kafka_bootstrap`` (session scope) is ``$DORYLUS_KAFKA_BOOTSTRAP`` when that is set (an external broker the
tests do not own), else the bootstrap of a single-node Apache Kafka broker that ``infra/local/kafka.sh`` starts
for this test session (in a private state dir, on a free port) and stops at the end of the session.

``kafka_scram`` (session scope, started only when a test asks for it) is a second broker that behaves like Amazon
MSK with SASL/SCRAM (``kafka.sh start --scram``): its client port is SASL_SSL with mechanism SCRAM-SHA-512 and a
self-signed certificate for 127.0.0.1/localhost. The fixture returns the broker's ``client.json``::

    {"bootstrap": "127.0.0.1:PORT", "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
     "username": "dorylus", "password": "<random>", "cafile": "/abs/path/tls/ca.pem"}

i.e. kafka-python's ``security_protocol``, ``sasl_mechanism``, ``sasl_plain_username``, ``sasl_plain_password``
and ``ssl_cafile``.

``kafka_cluster`` (session scope, started only when a test asks for it) is a replicated cluster of three KRaft
brokers (``kafka.sh start --brokers 3``) behind a TCP fault proxy (`pipelines.transports.faultproxy`): each
broker has, besides its direct client port (``cluster.bootstrap``, for the tests' own admin work), one client
listener per network path in ``LocalKafkaCluster.PATHS``, advertised at a proxy port, so a client that
bootstraps at ``cluster.bootstrap_via(path)`` reaches every broker only through that path's proxy links
(``<path>-<node>``): ``cluster.proxy.cut("isolated-*", 10)`` cuts exactly the clients of that path.
``cluster.kill(node)`` SIGKILLs a broker, ``cluster.start_node(node)`` brings it back (same ports and data).

Fault tests stop and start that broker mid-test with ``restart_broker()`` (data dir and port kept), or with
``stop_broker()`` / ``start_broker()`` to observe the outage in between. Against an external broker these
helpers skip the test. Where Java is missing, or the jars are not cached and mvn is missing, tests that use
the fixture skip (set ``DORYLUS_KAFKA_REQUIRED=1`` to make that an error instead).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KAFKA_SH = REPO / "infra" / "local" / "kafka.sh"

__all__ = [
    "KAFKA_SH",
    "LocalKafka",
    "LocalKafkaCluster",
    "kafka_bootstrap",
    "kafka_cluster",
    "kafka_scram",
    "local_broker",
    "restart_broker",
    "start_broker",
    "stop_broker",
]


class KafkaUnavailable(RuntimeError):
    """Kafka cannot be started on this machine (no Java, or no jars and no mvn; no keytool for SCRAM)."""


class LocalKafka:
    """One broker started by ``infra/local/kafka.sh`` in its own state dir.

    With ``scram="USER:PASSWORD"`` it is the MSK-like SASL_SSL/SCRAM-SHA-512 broker (``kafka.sh start --scram``);
    after ``start()``, ``client`` holds its parsed ``client.json`` (bootstrap, security_protocol, sasl_mechanism,
    username, password, cafile).
    """

    def __init__(self, state_dir: str | os.PathLike | None = None, port: int | None = None,
                 start_timeout_s: float = 180.0, scram: str | None = None):
        self._own_state_dir = state_dir is None
        self.state_dir = Path(state_dir or tempfile.mkdtemp(prefix="dorylus-kafka-"))
        self.port = port
        self.start_timeout_s = start_timeout_s
        self.scram = scram
        self.bootstrap: str | None = None
        self.client: dict | None = None  # client.json of a SCRAM broker
        self.startup_s: float | None = None  # wall time of the last start (fetch included when it fetched)
        self.start_args: list[str] = []       # more `kafka.sh start` options

    def _run(self, *args: str, timeout: float) -> str:
        cmd = ["bash", str(KAFKA_SH), *args, "--state-dir", str(self.state_dir)]
        env = dict(os.environ)
        env.setdefault("PYTHON", sys.executable)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0:
            log = self.state_dir / "kafka.log"
            tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
            raise RuntimeError(
                f"{' '.join(cmd)} failed (rc={proc.returncode}):\n{proc.stderr}\n--- kafka.log tail ---\n{tail}")
        return proc.stdout

    def start(self) -> str:
        """Start (formatting storage on first start), wait until ready; returns ``127.0.0.1:PORT``."""
        if shutil.which("java") is None:
            raise KafkaUnavailable("java not found on PATH")
        args = ["start", "--owner-pid", str(os.getpid()), "--timeout", str(int(self.start_timeout_s))]
        if self.port:
            args += ["--port", str(self.port)]
        args += self.start_args
        if self.scram:
            if shutil.which("keytool") is None:
                raise KafkaUnavailable("keytool not found on PATH (needed for the SCRAM broker's certificate)")
            args += ["--scram", self.scram]
        t0 = time.monotonic()
        out = self._run(*args, timeout=self.start_timeout_s + 300)
        self.startup_s = time.monotonic() - t0
        self.bootstrap = out.strip().splitlines()[-1]
        self.port = int(self.bootstrap.split(",")[0].rsplit(":", 1)[1])
        if self.scram:
            self.client = json.loads((self.state_dir / "client.json").read_text())
        return self.bootstrap

    def stop(self, keep_data: bool = False, timeout_s: float = 30.0) -> None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL. Removes the data dir unless ``keep_data``."""
        args = ["stop", "--timeout", str(int(timeout_s))]
        if keep_data:
            args.append("--keep-data")
        self._run(*args, timeout=timeout_s + 60)

    def restart(self) -> str:
        """Stop cleanly and start again on the same port with the same data dir."""
        self.stop(keep_data=True)
        return self.start()

    @property
    def running(self) -> bool:
        cmd = ["bash", str(KAFKA_SH), "status", "--state-dir", str(self.state_dir)]
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0

    def close(self) -> None:
        """Stop and remove the state dir when this object created it."""
        try:
            self.stop()
        finally:
            if self._own_state_dir:
                shutil.rmtree(self.state_dir, ignore_errors=True)


class LocalKafkaCluster(LocalKafka):
    """Three (``brokers``) KRaft brokers by ``kafka.sh start --brokers N``, each with one advertised client
    listener per path in PATHS, and a `FaultProxy` serving those listeners' ports (see the module doc)."""

    PATHS = ("roles", "isolated")

    def __init__(self, brokers: int = 3, heap: str = "512m", **kw):
        super().__init__(**kw)
        self.brokers = brokers
        ports = _free_ports(brokers * len(self.PATHS))
        self.advertised = {path: ports[i * brokers:(i + 1) * brokers] for i, path in enumerate(self.PATHS)}
        self.start_args = ["--brokers", str(brokers), "--heap", heap]
        for path, ps in self.advertised.items():
            self.start_args += ["--listener", f"{path}={','.join(map(str, ps))}"]
        self.proxy = None

    def start(self) -> str:
        from pipelines.transports.faultproxy import FaultProxy, links_from_kafka_state

        boot = super().start()
        if self.proxy is None:
            self.proxy = FaultProxy(links_from_kafka_state(self.state_dir)).start()
        return boot

    def bootstrap_via(self, path: str) -> str:
        """The bootstrap list of a path: every broker's advertised proxy port of that path."""
        return ",".join(f"127.0.0.1:{p}" for p in self.advertised[path])

    def kill(self, node: int) -> None:
        """SIGKILL broker `node` (1-based), as a crash: no shutdown, its data stays."""
        self._run("kill", "--node", str(node), timeout=60)

    def start_node(self, node: int) -> None:
        """Start broker `node` again (same ports and data); returns once it sees every broker registered."""
        self._run("start", "--node", str(node), "--timeout", str(int(self.start_timeout_s)),
                  timeout=self.start_timeout_s + 60)

    def nodes_running(self) -> int:
        cmd = ["bash", str(KAFKA_SH), "status", "--state-dir", str(self.state_dir)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
        return sum(" running " in ln for ln in out.splitlines())

    def close(self) -> None:
        try:
            if self.proxy is not None:
                self.proxy.stop()
        finally:
            super().close()


def _free_ports(n: int) -> list[int]:
    """n free ports below the ephemeral range (the brokers' own outgoing connections cannot take them before
    the proxy listens on them)."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    candidates = list(range(10000, max(low, 10100)))
    random.shuffle(candidates)
    out = []
    for port in candidates:
        if len(out) == n:
            break
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        out.append(port)
    return out


def _check_can_start(scram: bool = False) -> None:
    if shutil.which("java") is None:
        raise KafkaUnavailable("java not found on PATH")
    if scram and shutil.which("keytool") is None:
        raise KafkaUnavailable("keytool not found on PATH (needed for the SCRAM broker's certificate)")
    cache = Path(os.environ["DORYLUS_CACHE"]) / "kafka" if os.environ.get("DORYLUS_CACHE") else REPO / ".cache" / "kafka"
    version = os.environ.get("DORYLUS_KAFKA_VERSION", "4.1.2")
    if not (cache / version / "jars" / ".complete").exists() and shutil.which("mvn") is None:
        raise KafkaUnavailable(f"Kafka jars not cached in {cache / version} and mvn not found to fetch them")


# ------------------------------------------------------------------------------------------ session singletons
# One broker of each kind per test process, shared by every module that imports the fixtures (pytest makes one
# fixture definition per importing module, so each broker is reference-counted here).
_lock = threading.Lock()


class _Shared:
    """A broker started on first use and stopped when its last user lets go."""

    def __init__(self, label: str, scram: bool, make=None):
        self.label, self.scram = label, scram
        self.make = make or (lambda: LocalKafka(scram=f"dorylus:{secrets.token_urlsafe(18)}" if scram else None))
        self.broker: LocalKafka | None = None
        self.refs = 0

    def acquire(self) -> LocalKafka:
        with _lock:
            if self.broker is None:
                _check_can_start(scram=self.scram)
                broker = self.make()
                try:
                    broker.start()
                except BaseException:
                    broker.close()
                    raise
                print(f"\n[kafka_fixtures] started {self.label} at {broker.bootstrap} in {broker.startup_s:.1f}s "
                      f"(state {broker.state_dir})", file=sys.stderr)
                self.broker = broker
            self.refs += 1
            return self.broker

    def release(self) -> None:
        with _lock:
            self.refs -= 1
            if self.refs <= 0 and self.broker is not None:
                broker, self.broker, self.refs = self.broker, None, 0
                broker.close()

    def fixture_value(self, value):
        """Yield value(broker) for a test; skip where Kafka cannot run (unless DORYLUS_KAFKA_REQUIRED=1)."""
        try:
            broker = self.acquire()
        except KafkaUnavailable as e:
            if os.environ.get("DORYLUS_KAFKA_REQUIRED") == "1":
                raise
            pytest.skip(f"no {self.label} broker: {e}")
        try:
            yield value(broker)
        finally:
            self.release()


_plain = _Shared("Kafka", scram=False)
_scram = _Shared("SASL_SSL/SCRAM-SHA-512 Kafka", scram=True)
_cluster = _Shared("3-broker Kafka cluster", scram=False, make=LocalKafkaCluster)


def local_broker() -> LocalKafka | None:
    """The broker this test process started, or None (external broker / none started yet)."""
    return _plain.broker


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    """Bootstrap servers (``host:port``) of a Kafka broker for this test session."""
    external = os.environ.get("DORYLUS_KAFKA_BOOTSTRAP")
    if external:
        yield external
        return
    yield from _plain.fixture_value(lambda b: b.bootstrap)


@pytest.fixture(scope="session")
def kafka_scram() -> dict:
    """An MSK-like SASL_SSL/SCRAM-SHA-512 broker for this test session (started only when a test asks): its
    client.json as a dict (bootstrap, security_protocol, sasl_mechanism, username, password, cafile)."""
    yield from _scram.fixture_value(lambda b: dict(b.client))


@pytest.fixture(scope="session")
def kafka_cluster() -> LocalKafkaCluster:
    """A 3-broker cluster behind a fault proxy for this test session (started only when a test asks)."""
    yield from _cluster.fixture_value(lambda b: b)


def _managed() -> LocalKafka:
    if os.environ.get("DORYLUS_KAFKA_BOOTSTRAP"):
        pytest.skip("broker is external (DORYLUS_KAFKA_BOOTSTRAP); cannot stop/restart it")
    if _plain.broker is None:
        raise RuntimeError("no local broker: request the kafka_bootstrap fixture first")
    return _plain.broker


def restart_broker() -> str:
    """Stop the session broker cleanly and start it again: same port, same data. Returns the bootstrap."""
    return _managed().restart()


def stop_broker(timeout_s: float = 30.0) -> None:
    """Stop the session broker, keeping its data and port, until ``start_broker()``."""
    _managed().stop(keep_data=True, timeout_s=timeout_s)


def start_broker() -> str:
    """Start the session broker again after ``stop_broker()`` (same port, same data)."""
    return _managed().start()
