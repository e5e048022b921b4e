"""Helpers shared by the tests (no tests here): a local Kafka broker (kafka.py), Kafka training runs
(kafka_runs.py), captured tensor tasks and AWS fakes for the Lambda tests (lambda_tasks.py). Their fixtures are
defined in tests/conftest.py; test modules import the plain helpers from here, never from another test module."""
import os
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[2]


def datasets_dir() -> Path:
    """The real datasets: $DORYLUS_DATA_DIR, else ../shared/datasets beside the repository."""
    env = os.environ.get("DORYLUS_DATA_DIR")
    return Path(env) if env else REPO.parent / "shared" / "datasets"


# A test's record_property key for a line that tests/conftest.py prints at the end of the session; properties travel
# with the report, so this also works when an xdist worker ran the test.
SUMMARY_LINE = "summary_line"


class ConsumedRecord(NamedTuple):
    """A record as kafka-python's consumer yields it: the fields the transports read, for tests that feed a reader
    without a broker."""
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
