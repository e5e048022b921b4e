"""Shared pytest fixtures: the datasets folder, Kafka brokers, the FlinkRunner's flags, the memory-engine reference
run of the Kafka fault tests, and AWS environments for moto. The helpers behind them live in tests/support/."""
import os
import shutil
import sys
import tempfile

# One persistent XLA compilation cache per test run, set before jax is imported: the same programs (the trainer's
# step at Cora's shapes, the graph servers' kernels) are compiled again and again by the tests, by the xdist
# workers and by the role processes they spawn (all inherit it through the environment); a hit loads the executable
# the first compile produced, so results are unchanged. A fresh folder per run, so a test that counts compiles sees
# what this run compiled; the process that made it removes it at the end.
_XLA_CACHE_OWNER = "DORYLUS_TESTS_XLA_CACHE_OWNER"
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="dorylus-tests-xla-")
    os.environ[_XLA_CACHE_OWNER] = str(os.getpid())
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import pytest  # noqa: E402

from ops import refs  # noqa: E402
from pipelines.beam.runners import RunnerUnavailable, runner_options  # noqa: E402
from tests.support import SUMMARY_LINE, datasets_dir  # noqa: E402
from tests.support.kafka import KafkaUnavailable, LocalKafkaCluster, SessionBroker  # noqa: E402
from tests.support.kafka_runs import EPOCHS  # noqa: E402
from tests.support.lambda_fleet import FleetUnavailable, LocalLambdaFleet, check_can_start  # noqa: E402

EXTERNAL_KAFKA = "DORYLUS_KAFKA_BOOTSTRAP"

_plain_broker = SessionBroker("Kafka", scram=False)
_scram_broker = SessionBroker("SASL_SSL/SCRAM-SHA-512 Kafka", scram=True)
_cluster = SessionBroker("3-broker Kafka cluster", scram=False, make=LocalKafkaCluster)


_summary_lines: list[str] = []

# Fixtures that start a session-wide service (a JVM broker or cluster, the Flink job server, the emulator fleet).
SERVICE_FIXTURES = frozenset({"kafka_bootstrap", "kafka_broker", "kafka_scram", "kafka_cluster", "flink_flags",
                              "lambda_fleet", "fleet_env"})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Groups for ``pytest -n N --dist loadgroup`` (.ci/run): every module that uses a service runs on one worker, so
    each service starts once per run; a module with module-scoped fixtures stays on one worker, so they are built
    once; every other test is its own unit, so the long ones spread over the workers. Without xdist the marks do
    nothing. (tryfirst: xdist's worker turns the marks into nodeid suffixes in its own hook, after this one.)"""
    with_services = {_module(item) for item in items if SERVICE_FIXTURES & set(getattr(item, "fixturenames", ()))}
    with_module_state = {_module(item) for item in items if _uses_module_fixture(item)}
    for item in items:
        name = _module(item)
        if name in with_services:
            item.add_marker(pytest.mark.xdist_group("services"))
        elif name in with_module_state:
            item.add_marker(pytest.mark.xdist_group(name))


def pytest_configure(config):
    """Refuse ``--dist loadgroup`` where it silently does not group: pytest 9.2's structured node ids drop the
    group suffix pytest-xdist 3.8 relies on (pytest-dev/pytest-xdist#1386), so each worker would start its own
    brokers, cluster and Flink job server and the run would be slower, not faster."""
    if config.getoption("dist", "no") != "loadgroup":
        return
    from importlib.metadata import version

    def major_minor(name):
        return tuple(int(p) for p in version(name).split(".")[:2])
    if major_minor("pytest") >= (9, 2) and major_minor("pytest-xdist") <= (3, 8):
        raise pytest.UsageError(f"--dist loadgroup does not group with pytest {version('pytest')} and pytest-xdist "
                                f"{version('pytest-xdist')} (pytest-dev/pytest-xdist#1386): install 'pytest<9.2'")


def _module(item) -> str:
    return item.module.__name__ if getattr(item, "module", None) is not None else item.nodeid.split("::")[0]


def _uses_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d and d[-1].scope in ("module", "class", "package") for d in defs)


def pytest_runtest_logreport(report):
    """Collect the lines tests record under SUMMARY_LINE (the report carries them, also from an xdist worker)."""
    if report.when == "call":
        _summary_lines.extend(v for k, v in report.user_properties if k == SUMMARY_LINE)


def pytest_terminal_summary(terminalreporter):
    for line in _summary_lines:
        terminalreporter.write_line(line)


def pytest_unconfigure(config):
    if os.environ.get(_XLA_CACHE_OWNER) == str(os.getpid()):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture
def fresh_compiles():
    """Turns the run's persistent compilation cache off for one test, for a test that counts XLA compiles."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


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
