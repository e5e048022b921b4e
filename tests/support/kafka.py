"""A real Kafka broker for the tests that need one, started by ``infra/local/kafka.sh`` (and for bench/kafka.py).

The fixtures that use it are in tests/conftest.py::

    pytestmark = pytest.mark.kafka

    def test_something(kafka_bootstrap):
        producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)

``kafka_bootstrap`` (session scope) is ``$DORYLUS_KAFKA_BOOTSTRAP`` when that is set (an external broker the
tests do not own), else the bootstrap of a single-node Apache Kafka broker (:class:`LocalKafka`) started for this
test session (in a private state dir, on a free port) and stopped at the end of the session.

``kafka_scram`` (session scope, started only when a test asks for it) is a second broker that behaves like Amazon
MSK with SASL/SCRAM (``kafka.sh start --scram``): its client port is SASL_SSL with mechanism SCRAM-SHA-512 and a
self-signed certificate for 127.0.0.1/localhost. The fixture returns the broker's ``client.json``::

    {"bootstrap": "127.0.0.1:PORT", "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
     "username": "dorylus", "password": "<random>", "cafile": "/abs/path/tls/ca.pem"}

i.e. kafka-python's ``security_protocol``, ``sasl_mechanism``, ``sasl_plain_username``, ``sasl_plain_password``
and ``ssl_cafile``.

``kafka_cluster`` (session scope, started only when a test asks for it) is a replicated cluster of three KRaft
brokers (``kafka.sh start --brokers 3``, :class:`LocalKafkaCluster`) behind a TCP fault proxy
(`pipelines.transports.faultproxy`): each broker has, besides its direct client port (``cluster.bootstrap``, for
the tests' own admin work), one client listener per network path in ``LocalKafkaCluster.PATHS``, advertised at a
proxy port, so a client that bootstraps at ``cluster.bootstrap_via(path)`` reaches every broker only through that
path's proxy links (``<path>-<node>``): ``cluster.proxy.cut("isolated-*", 10)`` cuts exactly the clients of that
path. ``cluster.kill(node)`` SIGKILLs a broker, ``cluster.start_node(node)`` brings it back (same ports and data).

Fault tests stop and start that broker mid-test through the ``kafka_broker`` fixture (the session's
:class:`LocalKafka`: ``restart()`` keeps data dir and port; ``stop(keep_data=True)`` / ``start()`` to observe the
outage in between); against an external broker it skips the test. Where Java is missing, or the jars are not
cached and mvn is missing, tests that use the fixtures skip (set ``DORYLUS_KAFKA_REQUIRED=1`` to make that an
error instead).
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipelines.transports.faultproxy import FaultProxy, links_from_kafka_state

REPO = Path(__file__).resolve().parents[2]
KAFKA_SH = REPO / "infra" / "local" / "kafka.sh"

__all__ = ["KAFKA_SH", "KafkaUnavailable", "LocalKafka", "LocalKafkaCluster", "SessionBroker", "check_can_start",
           "free_ports"]


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
        ports = free_ports(brokers * len(self.PATHS))
        self.advertised = {path: ports[i * brokers:(i + 1) * brokers] for i, path in enumerate(self.PATHS)}
        self.start_args = ["--brokers", str(brokers), "--heap", heap]
        for path, ps in self.advertised.items():
            self.start_args += ["--listener", f"{path}={','.join(map(str, ps))}"]
        self.proxy = None

    def start(self) -> str:
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


def free_ports(n: int) -> list[int]:
    """n free ports below the ephemeral range (the brokers' own outgoing connections cannot take them before
    the proxy listens on them)."""
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
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        out.append(port)
    return out


def check_can_start(scram: bool = False) -> None:
    """KafkaUnavailable unless Java (keytool for SCRAM) and the jars (or mvn to fetch them) are here."""
    if shutil.which("java") is None:
        raise KafkaUnavailable("java not found on PATH")
    if scram and shutil.which("keytool") is None:
        raise KafkaUnavailable("keytool not found on PATH (needed for the SCRAM broker's certificate)")
    base = os.environ.get("DORYLUS_CACHE")
    cache = Path(base) / "kafka" if base else REPO / ".cache" / "kafka"
    version = os.environ.get("DORYLUS_KAFKA_VERSION", "4.1.2")
    if not (cache / version / "jars" / ".complete").exists() and shutil.which("mvn") is None:
        raise KafkaUnavailable(f"Kafka jars not cached in {cache / version} and mvn not found to fetch them")


# ------------------------------------------------------------------------------------------ session broker
class SessionBroker:
    """A broker started on first use (:meth:`start`) and stopped by :meth:`close`: what the ``kafka_bootstrap``
    and ``kafka_scram`` fixtures of tests/conftest.py hold for the whole test session."""

    def __init__(self, label: str, scram: bool, make=None):
        self.label, self.scram = label, scram
        self.make = make or (lambda: LocalKafka(scram=f"dorylus:{secrets.token_urlsafe(18)}" if scram else None))
        self.broker: LocalKafka | None = None

    def start(self) -> LocalKafka:
        """The running broker, started now if need be; KafkaUnavailable where Kafka cannot run here."""
        if self.broker is None:
            check_can_start(scram=self.scram)
            broker = self.make()
            try:
                broker.start()
            except BaseException:
                broker.close()
                raise
            print(f"\n[tests.support.kafka] started {self.label} at {broker.bootstrap} in {broker.startup_s:.1f}s "
                  f"(state {broker.state_dir})", file=sys.stderr)
            self.broker = broker
        return self.broker

    def close(self) -> None:
        if self.broker is not None:
            broker, self.broker = self.broker, None
            broker.close()
