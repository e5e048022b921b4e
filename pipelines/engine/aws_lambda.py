"""Tensor workers on AWS Lambda: a `TensorWorker` that runs each tensor task with boto3 `lambda.invoke`.

It consumes the tensor channel like the local pool (weight versions from the weights channel, replies on the graph
server's result channel, dW to the parameter server) and runs every task as one synchronous (RequestResponse)
invocation of the function whose handler is `ops.lambda_handler.handler` (events and responses:
`schemas/lambda_events.py`):

- bounded concurrency: a set of invoker threads (fixed `concurrency`, or autotuned from the task backlog, starting
  at min(#intervals, 100) as Dorylus does);
- payloads: the task travels inline (base64 Arrow IPC, zstd-compressed) while the event fits Lambda's 6 MB
  invoke limit, else through S3 (put, pass the reference, delete after use); the output comes back inline or,
  when over the limit, by reference under the run's S3 prefix; weight versions go inline when small, else once
  per version to S3 (warm functions cache them by key);
- retries: throttling (TooManyRequestsException, HTTP 429), Lambda service errors and function errors (crash,
  timeout, out of memory; `FunctionError` in the response) and handler errors marked retryable are retried with
  exponential backoff and full jitter, at most `max_retries` times per task; then the task's reply is an ERROR
  that is *not* retryable, so the graph server stops the run rather than relaunch it (no retry storm). Errors
  that retrying cannot fix (missing function, access denied, missing credentials, invalid task) fail at once, and
  after the first such error no further invocation is made;
- stragglers: as with the local pool, the graph servers relaunch late tasks (max(min_s, k x EMA)); a relaunched
  duplicate whose original already succeeded is dropped here before it is invoked (no cost).

Billed duration comes from each invocation's log tail (`LogType="Tail"`: the REPORT line's "Billed Duration"),
else from the runtime's own timing in the response (`schemas.lambda_events.billed_ms`), memory from the
function's configuration; both feed the run's cost (`pipelines.engine.cost`).

Endpoints (`--lambda-endpoint URL[,URL...]` or AWS_ENDPOINT_URL_LAMBDA; `infra/local/lambda.sh` starts a local fleet of
Runtime Interface Emulators): one client per endpoint, one invocation at a time on each (`lambda_fleet.Endpoints`),
so concurrency is the number of endpoints; a retry goes to another endpoint, an endpoint that does not answer is
set aside for a while. The emulator has no management API (GetFunction) and no log tail: the backend says so
once and goes on, bills the duration the runtime timed itself (invocation start to handler end, plus init when
cold) as the cost model's figure, and reads the runtimes' own REPORT lines from
their logs beside it (`runtime_reports` in the pool's stats). A runtime error the emulator reports as a bare
`{"errorType", "errorMessage"}` body (200) or as a 502 (the runtime process died) is a function error, retried.
"""
from __future__ import annotations

import base64
import collections
import json
import logging
import random
import re
import threading
import time
import uuid

import numpy as np

from ops import refs
from pipelines.config import ConfigError
from pipelines.engine import lambda_fleet
from pipelines.engine.autotune import Autotuner
from pipelines.engine.messages import EngineError
from ops.params import flatten, stage_slice, stages_of
from pipelines.engine.pools import MAX_WORKERS, QueuedPool, autotune_start
from schemas import lambda_events as events
from schemas.tasks import Channel, Message, TaskKind

INVOKE_LIMIT = events.INVOKE_LIMIT_BYTES - 16 * 1024   # headroom for the event's JSON around the payload
WEIGHTS_INLINE_LIMIT = 1024 * 1024                  # larger weight versions go to S3 (once per version)
THROTTLE_CODES = {"TooManyRequestsException", "ThrottlingException", "Throttling", "RequestLimitExceeded",
                  "EC2ThrottledException", "SlowDown"}
TRANSIENT_CODES = {"ServiceException", "ServiceUnavailableException", "InternalFailure", "ResourceNotReadyException",
                   "ResourceConflictException", "EC2UnexpectedException", "ENILimitReachedException",
                   "SubnetIPAddressLimitReachedException", "RequestTimeout", "InternalError"}
_BILLED_RE = re.compile(r"Billed Duration:\s*([0-9.]+)\s*ms")
_MEMORY_RE = re.compile(r"Memory Size:\s*([0-9]+)\s*MB")
RUNTIME_ERROR_PREFIXES = ("Runtime.", "Sandbox.")
log = logging.getLogger(__name__)


def _runtime_error(resp, body: bytes) -> str | None:
    """'Unhandled' when a response without Lambda's FunctionError header is the runtime's error, not the handler's
    (the emulator returns an uncaught exception's {"errorType", "errorMessage"} and a timeout as plain 200s)."""
    if isinstance(resp, dict) and "ok" not in resp and "errorType" in resp and "errorMessage" in resp:
        return "Unhandled"
    if resp is None and body.startswith(b"Task timed out after"):
        return "Unhandled"
    return None


class AwsSetupError(ConfigError):
    """The AWS side is not usable as configured (credentials, region, function, bucket); one line, no retry."""


class TaskFailed(Exception):
    def __init__(self, type_: str, message: str, fatal: bool = False):
        super().__init__(message)
        self.type, self.message, self.fatal = type_, message, fatal


def _client_error(e) -> tuple[str, int, str]:
    r = getattr(e, "response", {}) or {}
    return (str(r.get("Error", {}).get("Code", "")), int(r.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0),
            str(r.get("Error", {}).get("Message", e)))


class AwsLambdaPool(QueuedPool):
    """Tensor tasks on AWS Lambda, `concurrency` invocations at a time (None: autotuned)."""

    backend = "aws"
    billing = "lambda"

    def __init__(self, transport, model_spec: dict, *, function: str, bucket: str | None = None,
                 region: str | None = None, prefix: str = "tensor-workers", concurrency: int | None = None,
                 start_workers: int = 8, session=None, lambda_client=None, s3_client=None, max_retries: int = 4,
                 backoff_s: float = 0.2, backoff_cap_s: float = 5.0, compression: str | None = "zstd",
                 run_id: str | None = None, invoke_limit: int = INVOKE_LIMIT,
                 weights_inline_limit: int = WEIGHTS_INLINE_LIMIT, memory_mb: int | None = None,
                 keep_objects: bool = False, sleep=time.sleep, weight_timeout: float = 120.0, seed: int = 0,
                 endpoints: list[str] | None = None):
        self.endpoints = list(endpoints or [])
        if self.endpoints:  # one invocation at a time per endpoint
            concurrency = min(concurrency or len(self.endpoints), len(self.endpoints))
        tuner = None if concurrency else Autotuner(start_workers, 1, MAX_WORKERS)
        super().__init__(transport, model_spec, concurrency or tuner.n, autotuner=tuner, seed=seed,
                         weight_timeout=weight_timeout)
        self.function, self.bucket, self.region = function, bucket, region
        self.prefix = prefix.strip("/")
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.session, self.lam, self.s3 = session, lambda_client, s3_client
        self.max_retries, self.backoff_s, self.backoff_cap_s = max_retries, backoff_s, backoff_cap_s
        self.compression = compression
        self.invoke_limit, self.weights_inline_limit = invoke_limit, weights_inline_limit
        self.memory_mb = memory_mb
        self.keep_objects = keep_objects
        self.sleep = sleep
        self._rng = random.Random(seed + 104729)
        self._wrefs: dict[int, dict] = {}
        self._wlock = threading.Lock()
        self._done = collections.OrderedDict()
        self._fatal: str | None = None
        self._objects: set[tuple[str, str]] = set()
        self._checked = False
        self.counters = collections.Counter()
        self._eps: lambda_fleet.Endpoints | None = None
        self._clients_by_ep: list = []
        self._tls = threading.local()
        self.reports: lambda_fleet.RuntimeReports | None = None
        self._timed_rids: set[str] = set()        # billed by their runtime's timing, the post after it not yet
        self._billed_by_rid: dict[str, int] = {}  # with a fleet's REPORT lines: the cost model's ms per invocation

    @classmethod
    def from_config(cls, cfg, transport, model_spec: dict) -> "AwsLambdaPool":
        run_id = None
        if cfg.out:
            run_id = re.sub(r"[^A-Za-z0-9_.-]", "-", str(cfg.out).rstrip("/").rsplit("/", 1)[-1])[:64] or None
        endpoints = lambda_fleet.resolve_endpoints(getattr(cfg, "lambda_endpoint", None))
        return cls(transport, model_spec, function=cfg.function or lambda_fleet.EMULATOR_FUNCTION, bucket=cfg.bucket,
                   region=cfg.region, prefix=cfg.s3_prefix, concurrency=cfg.lambda_concurrency,
                   start_workers=autotune_start(cfg), run_id=run_id, seed=cfg.seed, endpoints=endpoints)

    # ------------------------------------------------------------------------------------------ setup
    def _clients(self) -> None:
        if self.lam is not None and (self.s3 is not None or self.bucket is None):
            return
        try:
            import boto3
            from botocore.config import Config
        except ModuleNotFoundError:
            raise AwsSetupError("the AWS backend needs boto3 (pip install 'dorylus[aws]')") from None
        from botocore.exceptions import NoRegionError

        if self.session is None:
            self.session = boto3.session.Session(region_name=self.region)
        if self.session.get_credentials() is None:
            raise AwsSetupError("no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                                "AWS_PROFILE, or run where an instance role is available")
        pool = max(self.size, MAX_WORKERS) + 8
        cfg = Config(retries={"total_max_attempts": 1}, connect_timeout=10, read_timeout=960,
                     max_pool_connections=pool)
        try:
            if self.lam is None and self.endpoints:
                self._endpoint_clients(cfg)
            if self.lam is None:
                self.lam = self.session.client("lambda", region_name=self.region, config=cfg)
                lambda_fleet.stamp_send(self.lam, self._tls)
            if self.s3 is None and self.bucket:
                self.s3 = self.session.client("s3", region_name=self.region, config=cfg)
        except NoRegionError:
            raise AwsSetupError("no AWS region: pass --region or set AWS_DEFAULT_REGION") from None

    def _endpoint_clients(self, cfg) -> None:
        """One Lambda client per endpoint URL, each invocation tagged with its own request id."""
        region = self.region or self.session.region_name or "us-east-1"  # an emulator ignores it; boto3 needs one
        for url in self.endpoints:
            c = self.session.client("lambda", region_name=region, endpoint_url=url, config=cfg)
            lambda_fleet.tag_requests(c, self._tls)
            lambda_fleet.stamp_send(c, self._tls)
            lambda_fleet.runtime_error_fields(c)
            self._clients_by_ep.append(c)
        self.lam = self._clients_by_ep[0]
        self._eps = lambda_fleet.Endpoints(self.endpoints)

    def _check_endpoints(self) -> dict | None:
        """GetFunction on every endpoint: unreachable is an error; an endpoint without the API (the emulator's
        404) is said once and passed over. The configuration of the first endpoint that has one."""
        from botocore.exceptions import BotoCoreError, ClientError

        conf, missing = None, []
        for url, c in zip(self.endpoints, self._clients_by_ep):
            try:
                got = c.get_function(FunctionName=self.function)["Configuration"]
                conf = conf or got
            except ClientError as e:
                code, status, msg = _client_error(e)
                if code == "ResourceNotFoundException":
                    raise AwsSetupError(f"Lambda function {self.function!r} not found at {url} (pass --function "
                                        f"NAME)") from None
                if status not in (404, 405, 501):
                    raise AwsSetupError(f"cannot use Lambda endpoint {url}: {code or status}: {msg}") from None
                missing.append(url)
            except BotoCoreError as e:
                raise AwsSetupError(f"cannot reach Lambda endpoint {url}: {e}") from None
        logs = lambda_fleet.fleet_logs(self.endpoints)
        self.reports = lambda_fleet.RuntimeReports(logs) if logs else None
        if missing:
            log.warning("AWS Lambda backend: %d of %d endpoints do not serve GetFunction (Runtime Interface "
                        "Emulators?): not checking the function there; memory from the runtimes' REPORT lines, else "
                        "lambda_memory_mb; REPORT lines read from %d emulator logs (lambda.sh state file)",
                        len(missing), len(self.endpoints), len(logs))
        return conf

    def check(self) -> None:
        """Fail fast, with one clear line, when the function, the bucket or the credentials are not usable."""
        if self._checked:
            return
        self._clients()
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        region = self.lam.meta.region_name
        try:
            if self._eps is not None:
                conf = self._check_endpoints() or {}
            else:
                conf = self.lam.get_function(FunctionName=self.function)["Configuration"]
        except NoCredentialsError:
            raise AwsSetupError("no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                                "AWS_PROFILE") from None
        except ClientError as e:
            code, status, msg = _client_error(e)
            if code == "ResourceNotFoundException" or status == 404:
                raise AwsSetupError(f"Lambda function {self.function!r} not found in {region} (deploy it with "
                                    f"infra/terraform, or pass --function NAME)") from None
            raise AwsSetupError(f"cannot use Lambda function {self.function!r} in {region}: {code}: {msg}") from None
        except BotoCoreError as e:
            raise AwsSetupError(f"cannot reach AWS Lambda in {region}: {e}") from None
        state = conf.get("State", "Active")
        if state == "Failed":
            raise AwsSetupError(f"Lambda function {self.function!r} is in state Failed: "
                                f"{conf.get('StateReason', '?')}")
        self.memory_mb = self.memory_mb or int(conf.get("MemorySize", 0) or 0) or None
        if self.bucket:
            try:
                self.s3.head_bucket(Bucket=self.bucket)
            except ClientError as e:
                code, status, msg = _client_error(e)
                if status == 404 or code in ("404", "NoSuchBucket", "NotFound"):
                    raise AwsSetupError(f"S3 bucket {self.bucket!r} does not exist (or is in another "
                                        f"account); pass an existing --bucket") from None
                raise AwsSetupError(f"cannot use S3 bucket {self.bucket!r}: {code or status}: {msg}") from None
            except BotoCoreError as e:
                raise AwsSetupError(f"cannot reach S3 for bucket {self.bucket!r}: {e}") from None
        self._checked = True

    def start(self) -> None:
        self.check()
        super().start()

    def stop(self) -> None:
        if self._eps is not None:
            self._eps.close()  # wakes invokers waiting for an endpoint
        super().stop()
        if self.reports is not None:  # the final figure: every REPORT line of the run read
            self.reports.summary(settle_s=1.0)
        if self.s3 is not None and not self.keep_objects:
            for bucket, key in list(self._objects):
                self._delete(bucket, key)

    # ------------------------------------------------------------------------------------------ S3
    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, self.run_id, *parts) if p)

    def _put(self, key: str, data: bytes) -> dict:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.s3.put_object(Bucket=self.bucket, Key=key, Body=data)
        except ClientError as e:
            code, status, msg = _client_error(e)
            raise TaskFailed("StorageError", f"S3 put s3://{self.bucket}/{key}: {code}: {msg}",
                             fatal=code in ("NoSuchBucket", "AccessDenied", "InvalidAccessKeyId")) from None
        except BotoCoreError as e:
            raise TaskFailed("StorageError", f"S3 put s3://{self.bucket}/{key}: {e}") from None
        with self._lock:
            self.counters["s3_puts"] += 1
            self.counters["s3_bytes_put"] += len(data)
            self._objects.add((self.bucket, key))
        return {"s3": {"bucket": self.bucket, "key": key}}

    def _fetch(self, ref: dict, what: str) -> bytes:
        if "s3" not in ref:
            return refs.fetch_ref(ref, what)
        from botocore.exceptions import BotoCoreError, ClientError

        if self.s3 is None:
            raise TaskFailed("StorageError", f"{what} came back by S3 reference, but no bucket is configured")
        b, k = ref["s3"]["bucket"], ref["s3"]["key"]
        try:
            data = self.s3.get_object(Bucket=b, Key=k)["Body"].read()
        except (ClientError, BotoCoreError) as e:
            raise TaskFailed("StorageError", f"S3 get s3://{b}/{k}: {e}") from None
        with self._lock:
            self.counters["s3_gets"] += 1
            self.counters["s3_bytes_get"] += len(data)
            self._objects.add((b, k))
        if not self.keep_objects:
            self._delete(b, k)
        return data

    def _delete(self, bucket: str, key: str) -> None:
        try:
            self.s3.delete_object(Bucket=bucket, Key=key)  # DELETE requests are free
        except Exception:  # cleanup is best effort
            return
        with self._lock:
            self._objects.discard((bucket, key))

    # ------------------------------------------------------------------------------------------ tasks
    def _weights_ref(self, version: int) -> dict:
        with self._wlock:
            ref = self._wrefs.get(version)
            if ref is not None:
                return ref
        params = self.weights.get(version, self.weight_timeout)
        data = events.encode_weights(version, flatten(params), self.run_id, self.compression)
        if len(data) * 4 // 3 <= self.weights_inline_limit or not self.bucket:
            ref = events.inline(data)
        else:
            ref = self._put(self._key("weights", f"v{version}.arrow"), data)
        with self._wlock:
            self._wrefs[version] = ref
            low = self.weights._retired_below
            for v in [v for v in self._wrefs if v < low]:
                old = self._wrefs.pop(v)
                if "s3" in old and not self.keep_objects:
                    self._delete(old["s3"]["bucket"], old["s3"]["key"])
        return ref

    def build_event(self, msg: Message) -> tuple[dict, int]:
        """The invocation event for a task (S3 offload included) and its size in bytes."""
        task = events.encode_task(msg.kind, msg.epoch, msg.stage, msg.interval, msg.partition, msg.version,
                                  msg.arrays, msg.meta, self.run_id, self.compression)
        wref = self._weights_ref(msg.version)
        tid = f"{msg.kind}-e{msg.epoch}-s{msg.stage}-i{msg.interval}-p{msg.partition}-" \
              f"a{msg.meta.get('attempt', 0)}-{uuid.uuid4().hex[:8]}"
        output = {"inline_limit": self.invoke_limit, "compression": self.compression}
        if self.bucket:
            output["s3"] = {"bucket": self.bucket, "prefix": self._key("out", tid) + "/"}
        event = events.make_event(events.inline(task), wref, output, kind=msg.kind)
        size = len(json.dumps(event))
        if size > self.invoke_limit:
            if not self.bucket:
                raise TaskFailed("PayloadTooLarge",
                                 f"task {msg.kind} (epoch {msg.epoch}, interval {msg.interval}, partition "
                                 f"{msg.partition}) is {size} bytes as an event, over Lambda's "
                                 f"{events.INVOKE_LIMIT_BYTES}-byte invoke limit, and no S3 bucket is configured "
                                 f"(--bucket) to pass it by reference", fatal=True)
            event["input"] = self._put(self._key("in", tid + ".arrow"), task)
            size = len(json.dumps(event))
        return event, size

    def _backoff(self, attempt: int) -> float:
        return self._rng.uniform(0, min(self.backoff_cap_s, self.backoff_s * 2 ** attempt))

    def invoke(self, event: dict, size: int) -> dict:
        """One task's invocation with bounded retries; returns the handler's successful response."""
        from botocore.exceptions import (BotoCoreError, ClientError, ConnectionClosedError, EndpointConnectionError,
                                         NoCredentialsError, ReadTimeoutError)

        payload = json.dumps(event).encode()
        last = "?"
        for attempt in range(self.max_retries + 1):
            if self._fatal is not None:
                raise TaskFailed("Aborted", f"not invoked: an earlier error stops the run: {self._fatal}", True)
            if attempt:
                with self._lock:
                    self.counters["retries"] += 1
                self.sleep(self._backoff(attempt - 1))
            try:
                r, body, rtt = self._invoke_once(payload)
            except NoCredentialsError:
                raise TaskFailed("NoCredentials", "no AWS credentials found", fatal=True) from None
            except ClientError as e:
                code, status, msg = _client_error(e)
                last = f"{code or status}: {msg}"
                if code in THROTTLE_CODES or status == 429:
                    with self._lock:
                        self.counters["throttled"] += 1
                    continue
                if code.startswith(RUNTIME_ERROR_PREFIXES):  # the emulator's 502: the runtime process died
                    self._count_function_error(code)
                    continue
                if code in TRANSIENT_CODES or status >= 500:
                    with self._lock:
                        self.counters["service_errors"] += 1
                    continue
                raise TaskFailed(code or "ClientError", f"invoke {self.function}: {last}", fatal=True) from None
            except (EndpointConnectionError, ConnectionClosedError, ReadTimeoutError) as e:
                last = f"{type(e).__name__}: {e}"
                with self._lock:
                    self.counters["connection_errors"] += 1
                continue
            except BotoCoreError as e:
                raise TaskFailed(type(e).__name__, f"invoke {self.function}: {e}", fatal=True) from None
            try:
                resp = json.loads(body)
            except ValueError:
                resp = None
            self._account(r, rtt, size, len(body), resp)
            ferr = r.get("FunctionError") or _runtime_error(resp, body)
            if ferr:
                err = resp if isinstance(resp, dict) else {}
                etype = str(err.get("errorType", "Sandbox.Timedout" if body.startswith(b"Task timed out") else "?"))
                self._count_function_error(etype)
                last = f"{ferr}: {etype}: {err.get('errorMessage', body[:200])}"
                continue
            if resp is None:
                raise TaskFailed("BadResponse", f"the function returned non-JSON: {body[:200]!r}")
            if not isinstance(resp, dict) or "ok" not in resp:
                raise TaskFailed("BadResponse", f"the function's response is not a handler response: "
                                                f"{str(resp)[:200]}", fatal=True)
            if resp["ok"]:
                self._account_handler_s3(event, resp)
                return resp
            err = resp.get("error", {})
            last = f"{err.get('type', '?')}: {err.get('message', '?')}"
            if err.get("retryable"):
                with self._lock:
                    self.counters["handler_retryable_errors"] += 1
                continue
            raise TaskFailed(err.get("type", "HandlerError"), err.get("message", "?"))
        raise TaskFailed("RetriesExhausted", f"gave up after {self.max_retries + 1} attempts; last error: {last}")

    def _invoke_once(self, payload: bytes) -> tuple[dict, bytes, float]:
        """One Invoke, on the next free endpoint when there are several: (response, body, round-trip seconds)."""
        from botocore.exceptions import ClientError

        def call(lam):
            # from the request's send, not from the call: serializing and signing (SigV4 hashes the payload) are
            # this process's work, which Lambda does not bill
            self._tls.sent_at = None
            t0 = time.monotonic()
            r = lam.invoke(FunctionName=self.function, InvocationType="RequestResponse", LogType="Tail",
                           Payload=payload)
            body = r["Payload"].read() if hasattr(r.get("Payload"), "read") else (r.get("Payload") or b"")
            return r, body, time.monotonic() - (self._tls.sent_at or t0)

        if self._eps is None:
            self._tls.last_request_id = None
            return call(self.lam)
        i = self._eps.acquire()
        rid = str(uuid.uuid4())
        self._tls.request_id = self._tls.last_request_id = rid
        reachable = False
        try:
            out = call(self._clients_by_ep[i])
            reachable = True
            return out
        except ClientError:
            reachable = True
            raise
        finally:
            self._tls.request_id = None
            self._eps.release(i, reachable)
            if reachable and self.reports is not None:
                self.reports.sent(rid)

    def _count_function_error(self, etype: str) -> None:
        with self._lock:
            self.counters["function_errors"] += 1
            self.counters[f"function_error:{etype}"] += 1

    def _account(self, r: dict, rtt: float, sent: int, received: int, resp) -> None:
        """Count an invocation and bill it: the REPORT line of its log tail (AWS), else the duration the runtime
        timed itself (`stats.runtime_s`, from the invocation's start to the handler's end, rounded up to 1 ms as
        Lambda rounds, plus the init phase when it was cold), else the exchange (an upper bound)."""
        billed, mem = None, None
        log = r.get("LogResult")
        if log:
            try:
                text = base64.b64decode(log).decode("utf-8", "replace")
                m = _BILLED_RE.search(text)
                billed = float(m.group(1)) if m else None
                mm = _MEMORY_RE.search(text)
                mem = int(mm.group(1)) if mm else None
            except (ValueError, TypeError):
                billed = None
        how = "billed_reported"
        if billed is None:
            billed, how = events.billed_ms(resp), "billed_runtime_timed"
        if billed is None:  # no REPORT line, no timing from the runtime: the exchange, rounded up to 1 ms
            billed, how = max(1, int(np.ceil(rtt * 1000))), "billed_estimated"
        rid = getattr(self._tls, "last_request_id", None)
        with self._lock:
            self.counters["invocations"] += 1
            self.counters["bytes_sent"] += sent
            self.counters["bytes_received"] += received
            self.counters[how] += 1
            self.counters["billed_ms"] += billed
            if mem:
                self.memory_mb = mem
            if rid is not None and how == "billed_runtime_timed":
                self._timed_rids.add(rid)
                if self.reports is not None:
                    self._billed_by_rid[rid] = billed
            self._bill_after(resp)

    def _bill_after(self, resp) -> None:
        """Add to the instance's previous invocation what its runtime did after the handler returned, as this
        response reports it (`schemas.lambda_events.billed_after`); only invocations of this run billed by their
        runtime's timing, each once. Under the lock."""
        after = events.billed_after(resp)
        if after is None or after[0] not in self._timed_rids:
            return
        rid, ms = after
        self._timed_rids.discard(rid)
        self.counters["billed_ms"] += ms
        self.counters["billed_after_measured"] += 1
        self.counters["billed_after_ms"] += ms
        if rid in self._billed_by_rid:
            self._billed_by_rid[rid] += ms

    def _after_estimate_ms(self, c: dict) -> float:
        """The mean measured post-handler ms of this run: the estimate for invocations whose post is not
        reported yet (each instance's latest one)."""
        n = c.get("billed_after_measured", 0)
        return c.get("billed_after_ms", 0) / n if n else 0.0

    def _account_handler_s3(self, event: dict, resp: dict) -> None:
        """S3 requests the function made: GET of an S3 input, GET of uncached S3 weights, PUT of outputs."""
        gets = int("s3" in event["input"]) + int("s3" in event["weights"] and
                                                not resp.get("stats", {}).get("weights_cached", False))
        puts = sum(1 for k in ("result", "grads") if isinstance(resp.get(k), dict) and "s3" in resp[k])
        with self._lock:
            self.counters["s3_gets"] += gets
            self.counters["s3_puts"] += puts

    def _key_done(self, msg: Message) -> bool:
        with self._lock:
            return msg.key in self._done

    def _run(self, msg: Message) -> None:
        if self._key_done(msg):
            with self._lock:
                self.counters["duplicates_skipped"] += 1
            return
        t0 = time.perf_counter()
        event = None
        try:
            event, size = self.build_event(msg)
            try:
                resp = self.invoke(event, size)
            finally:
                if "s3" in event["input"] and not self.keep_objects:
                    self._delete(event["input"]["s3"]["bucket"], event["input"]["s3"]["key"])
            arrays, grads, scalars = events.decode_result(resp, fetch=self._fetch)
        except EngineError:
            raise
        except Exception as e:  # TaskFailed, a handler error, a response that does not decode
            etype = getattr(e, "type", None) or type(e).__name__
            text = f"{etype}: {getattr(e, 'message', None) or e}"
            if isinstance(e, TaskFailed) and e.fatal and self._fatal is None:
                self._fatal = text
                self.error = EngineError(f"AWS Lambda backend: {text}")
            with self._lock:
                self.counters["failed_tasks"] += 1
            # Not retryable: the retries (bounded) happened here; a relaunch would start them over.
            self.transport.send(Channel.TENSOR_RESULTS, msg.partition, msg.replace(
                kind=TaskKind.ERROR, arrays={}, meta={**msg.meta, "error": text, "error_type": etype, "task": msg.kind,
                                               "retryable": False}))
            return
        dt = time.perf_counter() - t0
        with self._lock:
            self.busy_s += dt
            self.tasks += 1
            self._done[msg.key] = True
            while len(self._done) > 100_000:
                self._done.popitem(last=False)
        if grads:
            gmsg = Message(TaskKind.GRAD, msg.epoch, msg.stage, msg.interval, msg.partition, msg.version)
            for name in stages_of(grads):
                sub = {k: np.asarray(v) for k, v in stage_slice(grads, name).items()}
                self.transport.send(Channel.GRADS, 0, gmsg.replace(arrays=sub, meta={"stage_name": name}))
        reply = Message(msg.kind, msg.epoch, msg.stage, msg.interval, msg.partition, msg.version,
                        arrays={k: np.asarray(v) for k, v in arrays.items()},
                        meta={"attempt": msg.meta.get("attempt", 0), **scalars, "busy_s": dt})
        self.transport.send(Channel.TENSOR_RESULTS, msg.partition, reply)

    def stats(self) -> dict:
        st = super().stats()
        with self._lock:
            c = dict(self.counters)
        st.update({k: c.get(k, 0) for k in ("invocations", "retries", "throttled", "service_errors",
                                            "connection_errors", "function_errors", "handler_retryable_errors",
                                            "failed_tasks", "duplicates_skipped", "billed_ms", "billed_estimated",
                                            "billed_reported", "billed_runtime_timed",
                                            "s3_puts", "s3_gets", "s3_bytes_put", "s3_bytes_get", "bytes_sent",
                                            "bytes_received")})
        st["function_error_types"] = {k.split(":", 1)[1]: v for k, v in c.items() if k.startswith("function_error:")}
        with self._lock:
            pending = set(self._timed_rids) if c.get("billed_after_measured") else set()
            by_rid = dict(self._billed_by_rid)
        est = self._after_estimate_ms(c)
        st["billed_after_measured"] = c.get("billed_after_measured", 0)
        st["billed_after_estimated"] = len(pending)
        st["billed_ms"] = c.get("billed_ms", 0) + round(len(pending) * est)
        if self._eps is not None:
            st["endpoints"] = self._eps.stats()
        if self.reports is not None:
            rep = st["runtime_reports"] = self.reports.summary()
            # the cost model's figure over exactly the invocations whose REPORT line was read
            same = [by_rid[r] + (est if r in pending else 0.0) for r in self.reports.reported() if r in by_rid]
            rep["cost_model_billed_ms"] = sum(same)
            rep["cost_model_invocations"] = len(same)
            if self.memory_mb is None and isinstance(rep["memory_mb"], int):
                self.memory_mb = rep["memory_mb"]  # what the runtimes run with, as a log tail would say
        st.update(function=self.function, bucket=self.bucket, memory_mb=self.memory_mb, run_id=self.run_id)
        return st
