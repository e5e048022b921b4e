"""Shared pytest fixtures: the datasets folder, Kafka brokers, the FlinkRunner's flags, the memory-engine reference
run of the Kafka fault tests, and AWS environments for moto. The helpers behind them live in tests/support/."""
import os
import sys

import pytest

from ops import refs
from pipelines.beam.runners import RunnerUnavailable, runner_options
from tests.support import SUMMARY_LINE, datasets_dir
from tests.support.kafka import KafkaUnavailable, LocalKafkaCluster, SessionBroker
from tests.support.kafka_runs import EPOCHS
from tests.support.lambda_fleet import FleetUnavailable, LocalLambdaFleet, check_can_start

EXTERNAL_KAFKA = "DORYLUS_KAFKA_BOOTSTRAP"

_plain_broker = SessionBroker("Kafka", scram=False)
_scram_broker = SessionBroker("SASL_SSL/SCRAM-SHA-512 Kafka", scram=True)
_cluster = SessionBroker("3-broker Kafka cluster", scram=False, make=LocalKafkaCluster)


_summary_lines: list[str] = []


def pytest_runtest_logreport(report):
    """Collect the lines tests record under SUMMARY_LINE (the report carries them, also from an xdist worker)."""
    if report.when == "call":
        _summary_lines.extend(v for k, v in report.user_properties if k == SUMMARY_LINE)


def pytest_terminal_summary(terminalreporter):
    for line in _summary_lines:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def data_dir():
    """The real datasets: $DORYLUS_DATA_DIR, else ../shared/datasets beside the repository."""
    path = datasets_dir()
    if not path.is_dir():
        pytest.skip(f"dataset folder {path} not found; set DORYLUS_DATA_DIR")
    return path


def _session_broker(shared: SessionBroker):
    """Start ``shared`` for the session; skip where Kafka cannot run (unless DORYLUS_KAFKA_REQUIRED=1)."""
    try:
        broker = shared.start()
    except KafkaUnavailable as e:
        if os.environ.get("DORYLUS_KAFKA_REQUIRED") == "1":
            raise
        pytest.skip(f"no {shared.label} broker: {e}")
    try:
        yield broker
    finally:
        shared.close()


@pytest.fixture(scope="session")
def kafka_bootstrap():
    """Bootstrap servers (``host:port``) of a Kafka broker for this test session: $DORYLUS_KAFKA_BOOTSTRAP, else a
    local broker started now and stopped at the end of the session (tests/support/kafka.py)."""
    external = os.environ.get(EXTERNAL_KAFKA)
    if external:
        yield external
        return
    for broker in _session_broker(_plain_broker):
        yield broker.bootstrap


@pytest.fixture
def kafka_broker(kafka_bootstrap):
    """The session's local broker (a :class:`tests.support.kafka.LocalKafka`), for tests that stop or restart it
    mid-test; skips against an external broker."""
    if os.environ.get(EXTERNAL_KAFKA) or _plain_broker.broker is None:
        pytest.skip(f"broker is external ({EXTERNAL_KAFKA}); cannot stop/restart it")
    return _plain_broker.broker


@pytest.fixture(scope="session")
def kafka_scram():
    """An MSK-like SASL_SSL/SCRAM-SHA-512 broker for this test session (started only when a test asks): its
    client.json as a dict (bootstrap, security_protocol, sasl_mechanism, username, password, cafile)."""
    for broker in _session_broker(_scram_broker):
        yield dict(broker.client)


@pytest.fixture(scope="session")
def kafka_cluster():
    """A 3-broker cluster behind a fault proxy for this test session (started only when a test asks): the
    :class:`tests.support.kafka.LocalKafkaCluster`."""
    yield from _session_broker(_cluster)


@pytest.fixture(scope="session")
def flink_flags():
    """Beam flags of the FlinkRunner on an embedded Flink cluster, one job server for the whole session; skips
    where the job-server jar was not fetched (infra/local/flink.sh fetch), fails instead when $CI is set."""
    try:
        return runner_options("flink", [], shared_job_server=True)
    except RunnerUnavailable as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but the Flink job server is unavailable: {e}")
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def uninterrupted_cora_run(data_dir):
    """The Kafka fault tests' run (tests/support/kafka_runs.py), uninterrupted, on the in-memory engine
    (synchronous: the numbers a Kafka run must give)."""
    from pipelines.config import TrainConfig
    from pipelines.data.registry import load_dataset
    from pipelines.engine.runner import train_engine

    cora = load_dataset("cora", data_dir)
    cfg = TrainConfig(dataset="cora", data_dir=str(data_dir), model="gcn", partitions=2, intervals=4,
                      staleness=None, epochs=EPOCHS, patience=0).resolved()
    return train_engine(cfg, cora)


@pytest.fixture
def aws_env(monkeypatch):
    """Dummy AWS credentials and region (for moto), and a handler with no warm state."""
    from ops import lambda_handler

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    lambda_handler.clear_caches()
    yield
    lambda_handler.clear_caches()


@pytest.fixture
def no_aws_credentials(monkeypatch, tmp_path):
    """An environment with no AWS credentials at all (and no instance metadata)."""
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
              "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
              "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    yield


@pytest.fixture(scope="session")
def lambda_fleet() -> LocalLambdaFleet:
    """The session's fleet of 4 emulators and its S3 server (started on first use, stopped at the end)."""
    try:
        check_can_start()
    except FleetUnavailable as e:
        if os.environ.get("DORYLUS_LAMBDA_REQUIRED") == "1":
            pytest.fail(f"DORYLUS_LAMBDA_REQUIRED=1 but {e}")
        pytest.skip(f"no local Lambda fleet: {e}")
    fleet = LocalLambdaFleet()
    try:
        fleet.start()
    except Exception:
        fleet.close()
        raise
    print(f"\n[lambda fleet] {fleet.workers} emulators and S3 at {fleet.s3_endpoint} up in "
          f"{fleet.startup_s:.1f}s", file=sys.stderr)
    yield fleet
    fleet.close()


@pytest.fixture
def fleet_env(lambda_fleet, monkeypatch) -> LocalLambdaFleet:
    """This process's environment set for the fleet: its credentials, S3 endpoint and state dir."""
    for k in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_LAMBDA"):
        monkeypatch.delenv(k, raising=False)
    for k, v in lambda_fleet.env.items():
        monkeypatch.setenv(k, v)
    refs.reset_clients()
    yield lambda_fleet
    refs.reset_clients()
