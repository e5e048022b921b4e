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

Fault tests stop and start that broker mid-test through the ``kafka_broker`` fixture (the session's
:class:`LocalKafka`: ``restart()`` keeps data dir and port; ``stop(keep_data=True)`` / ``start()`` to observe the
outage in between); against an external broker it skips the test. Where Java is missing, or the jars are not
cached and mvn is missing, tests that use the fixtures skip (set ``DORYLUS_KAFKA_REQUIRED=1`` to make that an
error instead).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KAFKA_SH = REPO / "infra" / "local" / "kafka.sh"

__all__ = ["KAFKA_SH", "KafkaUnavailable", "LocalKafka", "SessionBroker", "check_can_start"]


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
        if self.scram:
            if shutil.which("keytool") is None:
                raise KafkaUnavailable("keytool not found on PATH (needed for the SCRAM broker's certificate)")
            args += ["--scram", self.scram]
        t0 = time.monotonic()
        out = self._run(*args, timeout=self.start_timeout_s + 300)
        self.startup_s = time.monotonic() - t0
        self.bootstrap = out.strip().splitlines()[-1]
        self.port = int(self.bootstrap.rsplit(":", 1)[1])
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

    def __init__(self, label: str, scram: bool):
        self.label, self.scram = label, scram
        self.broker: LocalKafka | None = None

    def start(self) -> LocalKafka:
        """The running broker, started now if need be; KafkaUnavailable where Kafka cannot run here."""
        if self.broker is None:
            check_can_start(scram=self.scram)
            broker = LocalKafka(scram=f"dorylus:{secrets.token_urlsafe(18)}" if self.scram else None)
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
