"""Shared pytest fixtures."""
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The real datasets: $DORYLUS_DATA_DIR, else ../shared/datasets beside the repository."""
    env = os.environ.get("DORYLUS_DATA_DIR")
    path = Path(env) if env else Path(__file__).resolve().parents[1].parent / "shared" / "datasets"
    if not path.is_dir():
        pytest.skip(f"dataset folder {path} not found; set DORYLUS_DATA_DIR")
    return path
