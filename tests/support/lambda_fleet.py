"""A local fleet of real Lambda runtimes for tests (emulators running awslambdaric, moto's S3 server); the
fixtures `lambda_fleet` and `fleet_env` in tests/conftest.py start it once per session.

`lambda_fleet` starts moto's standalone S3 server (`ThreadedMotoServer`) on a loopback port with one bucket, then
`infra/local/lambda.sh start --workers 4 --warm` (AWS Lambda Runtime Interface Emulators running
`python -m awslambdaric ops.lambda_handler.handler`, with AWS_ENDPOINT_URL_S3 and credentials pointing the handler
at the same S3 server), and stops both at the end of the session. Where the emulator is not built and no Go
toolchain can build it, or awslambdaric is not installed, the tests that use it skip (set
``DORYLUS_LAMBDA_REQUIRED=1`` to make that an error instead, as CI does).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAMBDA_SH = REPO / "infra" / "local" / "lambda.sh"
BUCKET = "dorylus-fleet"
WORKERS = 4
_REPORT = re.compile(rb"^REPORT RequestId: ", re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalLambdaFleet:
    """N emulators started by ``infra/local/lambda.sh`` in their own state dir, with a moto S3 server."""

    def __init__(self, workers: int = WORKERS):
        self.workers = workers
        self.state_dir = Path(tempfile.mkdtemp(prefix="dorylus-lambda-"))
        self.endpoints: list[str] = []
        self.emulators: list[dict] = []
        self.s3_server = None
        self.s3_endpoint: str | None = None
        self.bucket = BUCKET
        self.env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                    "DORYLUS_LAMBDA_STATE": str(self.state_dir)}
        self.startup_s: float | None = None

    def _run(self, *args: str, timeout: float) -> str:
        env = {**os.environ, **self.env, "PYTHON": sys.executable}
        env.pop("AWS_SESSION_TOKEN", None)
        env.pop("AWS_PROFILE", None)
        env.pop("AWS_ENDPOINT_URL_LAMBDA", None)
        proc = subprocess.run(["bash", str(LAMBDA_SH), *args, "--state-dir", str(self.state_dir)],
                              capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0:
            logs = "".join(p.read_text(errors="replace")[-2000:] for p in sorted(self.state_dir.glob("rie-*.log")))
            raise RuntimeError(f"lambda.sh {' '.join(args)} failed (rc={proc.returncode}):\n{proc.stderr}\n{logs}")
        return proc.stdout

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        t0 = time.monotonic()
        port = free_port()
        self.s3_server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self.s3_server.start()
        self.s3_endpoint = f"http://127.0.0.1:{port}"
        self.env["AWS_ENDPOINT_URL_S3"] = self.s3_endpoint
        self.s3().create_bucket(Bucket=self.bucket)
        self._run("build", timeout=900)
        out = self._run("start", "--workers", str(self.workers), "--warm", "--owner-pid", str(os.getpid()),
                        "--ready-timeout", "180", timeout=400)
        self.endpoints = out.split()
        self.emulators = json.loads((self.state_dir / "fleet.json").read_text())["emulators"]
        self.startup_s = time.monotonic() - t0

    def s3(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.s3_endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def close(self) -> None:
        try:
            self._run("stop", timeout=120)
        finally:
            if self.s3_server is not None:
                self.s3_server.stop()
            shutil.rmtree(self.state_dir, ignore_errors=True)

    # ------------------------------------------------------------------------------------------------ faults
    def log_size(self, k: int) -> int:
        return os.path.getsize(self.emulators[k]["log"])

    def reports_since(self, k: int, offset: int) -> int:
        with open(self.emulators[k]["log"], "rb") as f:
            f.seek(offset)
            return len(_REPORT.findall(f.read()))

    def runtime_pids(self, k: int) -> list[int]:
        import psutil

        return [c.pid for c in psutil.Process(self.emulators[k]["pid"]).children(recursive=True)]

    def kill_runtime(self, k: int) -> None:
        """SIGKILL emulator k's runtime process (awslambdaric); the emulator lives on and starts a new one."""
        for pid in self.runtime_pids(k):
            os.kill(pid, signal.SIGKILL)

    def kill_emulator(self, k: int) -> None:
        """SIGKILL emulator k and its runtime, and wait until it is gone: that endpoint is gone for good."""
        pids = self.runtime_pids(k)
        os.kill(self.emulators[k]["pid"], signal.SIGKILL)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10.0
        while self.alive(k) and time.monotonic() < deadline:
            time.sleep(0.02)

    def alive(self, k: int) -> bool:
        """Whether emulator k still runs. A killed emulator was started by lambda.sh in the background, so its
        parent is whichever process reaps orphans, which may do so late: a zombie counts as dead."""
        import psutil

        try:
            return psutil.Process(self.emulators[k]["pid"]).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


class FleetUnavailable(RuntimeError):
    """The fleet cannot run here: no emulator and no Go toolchain to build it, or no awslambdaric."""


def check_can_start() -> None:
    try:
        import awslambdaric  # noqa: F401
    except ImportError:
        raise FleetUnavailable("awslambdaric is not installed (pip install -e '.[test]')") from None
    try:
        from moto.server import ThreadedMotoServer  # noqa: F401
    except ImportError:
        raise FleetUnavailable("moto's server is not installed (pip install 'moto[server]')") from None
    cache = Path(os.environ["DORYLUS_CACHE"]) if os.environ.get("DORYLUS_CACHE") else REPO / ".cache"
    built = any((cache / "lambda-rie").glob("*/aws-lambda-rie"))
    if not built and shutil.which("go") is None:
        raise FleetUnavailable("the Lambda Runtime Interface Emulator is not built and the Go toolchain (go) is "
                               "not on PATH to build it")
