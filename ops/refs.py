"""Task references: the bytes an inline, S3 or Kafka reference names, and task outputs written to S3. The only
ops module that touches the network.

``boto3`` (present in the Lambda runtime) is imported on first use of an S3 reference only, ``kafka``
(kafka-python, in the project image) for Kafka references only: neither is a dependency of ``ops``. Errors are
:class:`schemas.lambda_events.HandlerError` (``StorageError``, ``InputUnavailable``, ``PayloadTooLarge``,
``DependencyMissing``), transient ones marked retryable.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Mapping

from schemas.lambda_events import HandlerError, check_ref, decode_inline

#: The largest task input (bytes of Arrow IPC) a handler accepts by reference; env DORYLUS_MAX_INPUT_BYTES.
DEFAULT_MAX_INPUT_BYTES = 2 * 1024 ** 3
_RETRYABLE_CODES = ("SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling",
                    "ThrottlingException", "RequestLimitExceeded")
_TRANSIENT_ERRORS = ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError")

_clients: dict = {}
_clients_lock = threading.Lock()


def max_input_bytes() -> int:
    """The input size limit: ``$DORYLUS_MAX_INPUT_BYTES``, else :data:`DEFAULT_MAX_INPUT_BYTES`."""
    try:
        return int(os.environ.get("DORYLUS_MAX_INPUT_BYTES", DEFAULT_MAX_INPUT_BYTES))
    except ValueError:
        return DEFAULT_MAX_INPUT_BYTES


def s3_client():
    """boto3's S3 client, created on first use and kept for warm invocations."""
    with _clients_lock:
        if "s3" not in _clients:
            try:
                import boto3
            except ModuleNotFoundError:
                raise HandlerError("DependencyMissing", "an S3 reference needs boto3, which is not installed") \
                    from None
            _clients["s3"] = boto3.client("s3")
        return _clients["s3"]


def reset_clients() -> None:
    """Forget the cached clients (the next reference creates new ones, e.g. under other credentials)."""
    with _clients_lock:
        _clients.clear()


def storage_error(e: Exception, what: str, where: str) -> HandlerError:
    """A botocore/transport exception as a StorageError, retryable when S3 throttled or failed on its side."""
    code, status = "", 0
    resp = getattr(e, "response", None)
    if isinstance(resp, Mapping):
        code = str(resp.get("Error", {}).get("Code", ""))
        status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    retryable = code in _RETRYABLE_CODES or status >= 500
    if not code:  # no HTTP answer at all (connection, credentials): transient at best
        retryable = type(e).__name__ in _TRANSIENT_ERRORS
    return HandlerError("StorageError", f"{what}: {where}: {code or type(e).__name__}: {e}", retryable)


def s3_get(val: Mapping, what: str) -> bytes:
    """The object of an S3 reference's value ``{"bucket", "key"}``."""
    s3 = s3_client()
    where = f"s3://{val['bucket']}/{val['key']}"
    try:
        obj = s3.get_object(Bucket=val["bucket"], Key=val["key"])
        size = int(obj.get("ContentLength", 0))
        if size > max_input_bytes():
            raise HandlerError("PayloadTooLarge", f"{what}: {where} holds {size} bytes, more than the handler "
                                                  f"accepts ({max_input_bytes()}, DORYLUS_MAX_INPUT_BYTES)")
        return obj["Body"].read()
    except HandlerError:
        raise
    except Exception as e:  # botocore ClientError and transport errors
        raise storage_error(e, what, where) from None


def s3_put(bucket: str, key: str, data: bytes) -> None:
    """Write a task output to S3."""
    try:
        s3_client().put_object(Bucket=bucket, Key=key, Body=data)
    except HandlerError:
        raise
    except Exception as e:
        raise storage_error(e, "output", f"s3://{bucket}/{key}") from None


def kafka_get(val: Mapping, what: str) -> bytes:
    """One record's value, read at (topic, partition, offset) with kafka-python (in the project image)."""
    try:
        from kafka import KafkaConsumer, TopicPartition
    except ModuleNotFoundError:
        raise HandlerError("DependencyMissing", f"{what}: a Kafka reference needs kafka-python, which is not "
                                                f"installed") from None
    tp = TopicPartition(val["topic"], val["partition"])
    where = f"kafka {val['topic']}[{val['partition']}]@{val['offset']}"
    try:
        consumer = KafkaConsumer(bootstrap_servers=val["bootstrap"], enable_auto_commit=False, group_id=None,
                                 fetch_max_bytes=max_input_bytes(), max_partition_fetch_bytes=max_input_bytes(),
                                 request_timeout_ms=30000, api_version_auto_timeout_ms=10000)
    except Exception as e:
        raise HandlerError("InputUnavailable", f"{what}: {where}: cannot reach the broker: {e}", True) from None
    try:
        consumer.assign([tp])
        consumer.seek(tp, val["offset"])
        deadline = time.monotonic() + float(val.get("timeout_s", 20))
        while time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500, max_records=1).values():
                for r in records:
                    if r.offset != val["offset"]:
                        raise HandlerError("InputUnavailable", f"{what}: {where}: offset {val['offset']} is gone "
                                                               f"(the first record is at {r.offset})")
                    if r.value is None:
                        raise HandlerError("InvalidInput", f"{what}: {where}: the record has no value")
                    return bytes(r.value)
        raise HandlerError("InputUnavailable", f"{what}: {where}: no record within the timeout", True)
    except HandlerError:
        raise
    except Exception as e:
        raise HandlerError("InputUnavailable", f"{what}: {where}: {type(e).__name__}: {e}", True) from None
    finally:
        consumer.close()


def fetch_ref(ref: Any, what: str) -> bytes:
    """The bytes a reference names (inline, S3 or Kafka); ``what`` names it in errors."""
    kind, val = check_ref(ref, what)
    if kind == "inline":
        return decode_inline(val, what)
    if kind == "s3":
        return s3_get(val, what)
    return kafka_get(val, what)
