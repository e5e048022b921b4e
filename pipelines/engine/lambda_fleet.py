"""Lambda Invoke endpoints given by URL (a local fleet of Runtime Interface Emulators, `infra/local/lambda.sh`):
which endpoint takes the next invocation, which are down, and the billed durations the runtimes report.

An endpoint is one Lambda instance: it serves one invocation at a time (an emulator given a second one at once
crashes: a nil-pointer panic in v1.23.0), so the
backend's concurrency is the number of endpoints and each invocation takes a free, live endpoint (the one idle
longest). An endpoint that does not answer (connection refused or cut) is down for a cooldown that doubles per
failure (1 s .. 30 s), then tried again; its task is retried on another one.

Billed duration: the emulator does not return a log tail (`LogType="Tail"`), but prints a REPORT line (Duration,
Billed Duration, Memory Size; Init Duration on a cold start, which it leaves out of Billed Duration and AWS
bills since 2025, so it is added here) per invocation to its log. Every invocation carries its own request id
(`X-Amzn-RequestId`, which the emulator uses as the invocation id), and `RuntimeReports` sums the REPORT lines of
exactly those ids from the logs that `lambda.sh` names in its state file (`fleet.json`).
"""
from __future__ import annotations

import json
import math
import os
import re
import threading
import time
from pathlib import Path

from pipelines.config import ConfigError, parse_endpoints

ENDPOINT_ENV = "AWS_ENDPOINT_URL_LAMBDA"   # boto3's own variable; here it may list several URLs
STATE_ENV = "DORYLUS_LAMBDA_STATE"
DEFAULT_STATE_DIR = Path(__file__).resolve().parents[2] / ".cache" / "lambda-state"
EMULATOR_FUNCTION = "function"             # the one function name the emulator serves
REQUEST_ID_HEADER = "X-Amzn-RequestId"
_REPORT_RE = re.compile(r"REPORT RequestId: (\S+)\t(?:Init Duration: ([0-9.]+) ms\t)?Duration: ([0-9.]+) ms\t"
                        r"Billed Duration: ([0-9.]+) ms\tMemory Size: ([0-9]+) MB")


def resolve_endpoints(value: str | None) -> list[str]:
    """The configured endpoints, else those of AWS_ENDPOINT_URL_LAMBDA (comma-separated), else none (AWS)."""
    return parse_endpoints(value) or parse_endpoints(os.environ.get(ENDPOINT_ENV))


def endpoint_share(value: str | None, k: int, n: int) -> str | None:
    """The endpoints tensor-worker process k of n invokes: every n-th one, so that no endpoint ever gets two
    invocations at once from different processes (an emulator given a second one crashes)."""
    urls = resolve_endpoints(value)
    if not urls or n == 1:
        return value
    if len(urls) < n:
        raise ConfigError(f"tensor-worker: --workers {n} needs at least {n} Lambda endpoints (each serves one "
                          f"invocation at a time), got {len(urls)}")
    return ",".join(urls[k::n])


def fleet_logs(urls: list[str], state_dir: str | Path | None = None) -> dict[str, str]:
    """{endpoint URL: its emulator's log} for the endpoints a `lambda.sh` state file knows."""
    path = Path(state_dir or os.environ.get(STATE_ENV) or DEFAULT_STATE_DIR) / "fleet.json"
    try:
        doc = json.loads(path.read_text())
        known = {e["url"].rstrip("/"): e["log"] for e in doc["emulators"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {u: known[u] for u in urls if u in known}


class Endpoints:
    """Free/busy/down state of N endpoints; `acquire` hands out a free, live one (idle longest first)."""

    def __init__(self, urls: list[str], cooldown_s: float = 1.0, max_cooldown_s: float = 30.0):
        self.urls = list(urls)
        self.cooldown_s, self.max_cooldown_s = cooldown_s, max_cooldown_s
        self._cv = threading.Condition()
        self._busy = [False] * len(urls)
        self._idle_since = [0.0] * len(urls)
        self._down_until = [0.0] * len(urls)
        self._failures = [0] * len(urls)
        self.invocations = [0] * len(urls)
        self.down_events = [0] * len(urls)
        self._closed = False

    def acquire(self) -> int:
        with self._cv:
            while not self._closed:
                now = time.monotonic()
                free = [i for i in range(len(self.urls)) if not self._busy[i] and self._down_until[i] <= now]
                if free:
                    i = min(free, key=lambda j: self._idle_since[j])
                    self._busy[i] = True
                    self.invocations[i] += 1
                    return i
                waits = [self._down_until[i] - now for i in range(len(self.urls))
                         if not self._busy[i] and self._down_until[i] > now]
                self._cv.wait(min(waits) if waits else None)
            raise RuntimeError("the endpoint set is closed")

    def release(self, i: int, reachable: bool) -> None:
        with self._cv:
            self._busy[i] = False
            self._idle_since[i] = time.monotonic()
            if reachable:
                self._failures[i] = 0
            else:
                self._failures[i] += 1
                self.down_events[i] += 1
                back = min(self.max_cooldown_s, self.cooldown_s * 2 ** (self._failures[i] - 1))
                self._down_until[i] = time.monotonic() + back
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def stats(self) -> list[dict]:
        with self._cv:
            now = time.monotonic()
            return [{"url": u, "invocations": self.invocations[i], "down_events": self.down_events[i],
                     "down_now": self._down_until[i] > now} for i, u in enumerate(self.urls)]


class RuntimeReports:
    """Billed durations of this run's invocations, from the REPORT lines in the emulators' logs."""

    def __init__(self, logs: dict[str, str]):
        self.logs = dict(logs)
        self._offset = {u: _size(p) for u, p in self.logs.items()}   # the logs before this run are not ours
        self._partial = {u: b"" for u in self.logs}
        self._sent: set[str] = set()
        self._seen: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def sent(self, request_id: str) -> None:
        with self._lock:
            self._sent.add(request_id)

    def _scan(self) -> None:
        for u, p in self.logs.items():
            try:
                with open(p, "rb") as f:
                    f.seek(self._offset[u])
                    data = self._partial[u] + f.read()
                    self._offset[u] = f.tell()
            except OSError:
                continue
            lines = data.split(b"\n")
            self._partial[u] = lines.pop()
            for line in lines:
                m = _REPORT_RE.search(line.decode("utf-8", "replace"))
                if m and m.group(1) in self._sent:
                    # AWS bills a cold start's init phase too (since 2025); the emulator reports it apart
                    init = math.ceil(float(m.group(2))) if m.group(2) else 0
                    self._seen[m.group(1)] = (float(m.group(4)) + init, int(m.group(5)))

    def reported(self) -> list[str]:
        """The request ids whose REPORT line has been read."""
        with self._lock:
            return list(self._seen)

    def summary(self, settle_s: float = 0.0) -> dict:
        """invocations sent and reported, billed ms, memory and GB-seconds (billed x memory, per invocation);
        settle_s: wait up to that long for REPORT lines not yet read (the run's final figure)."""
        deadline = time.monotonic() + settle_s
        with self._lock:
            self._scan()
            while len(self._seen) < len(self._sent) and time.monotonic() < deadline:
                time.sleep(0.05)
                self._scan()
            seen = list(self._seen.values())
            sent = len(self._sent)
        mems = sorted({m for _, m in seen})
        return {"source": "emulator REPORT lines", "logs": len(self.logs), "invocations_sent": sent,
                "invocations_reported": len(seen), "unreported": sent - len(seen),
                "billed_ms": sum(b for b, _ in seen), "memory_mb": mems[0] if len(mems) == 1 else mems,
                "gb_s": sum(b / 1000.0 * m / 1024.0 for b, m in seen)}


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def tag_requests(client, local: threading.local) -> None:
    """Send `local.request_id` as each Invoke's request id (the emulator names its REPORT line with it)."""

    def add_header(request, **kw):
        rid = getattr(local, "request_id", None)
        if rid:
            request.headers[REQUEST_ID_HEADER] = rid

    client.meta.events.register("before-sign.lambda.Invoke", add_header)


def stamp_send(client, local: threading.local) -> None:
    """Set `local.sent_at` when an Invoke request goes on the wire (after it is serialized and signed)."""

    def stamp(**kw):
        local.sent_at = time.monotonic()

    client.meta.events.register("before-send.lambda.Invoke", stamp)


def runtime_error_fields(client) -> None:
    """Read the runtime's error (`{"errorType", "errorMessage"}`, the body of the emulator's 502 when the runtime
    process died) into the ClientError's code and message, which botocore leaves empty for that body."""

    def parse(response_dict, customized_response_dict, **kw):
        if int(response_dict.get("status_code") or 0) < 500:
            return
        body = response_dict.get("body")
        if not isinstance(body, (bytes, bytearray)):
            return
        try:
            err = json.loads(body)
        except ValueError:
            return
        if isinstance(err, dict) and "errorType" in err:
            customized_response_dict["Error"] = {"Code": str(err["errorType"]),
                                                 "Message": str(err.get("errorMessage", ""))}

    client.meta.events.register("before-parse.lambda.Invoke", parse)
