"""The AWS Lambda backend (pipelines/engine/aws_lambda.py) against moto (S3, the Lambda management API) and,
for invoke, botocore's Stubber (moto cannot execute the function here: no Docker). Nothing here talks to AWS.

Covered: the request's shape, the response's decoding and billing, S3 offload of payloads over 6 MB, retries on
throttling with capped backoff, function and handler errors surfaced, fatal errors stopping invocations (no retry
storm), setup checks (missing function, bucket, credentials, region) and an engine run on Cora through the
backend whose results equal the local pool's."""
from __future__ import annotations

import json
import subprocess

import boto3
import numpy as np
import pytest
from botocore.stub import ANY, Stubber
from moto import mock_aws

from ops import lambda_handler as LH
from ops import models
from pipelines.engine import messages as M
from pipelines.engine.aws_lambda import AwsLambdaPool, AwsSetupError
from pipelines.engine.messages import Message
from pipelines.engine.param_server import unflatten
from pipelines.engine.tensor_worker import execute
from pipelines.transports.memory import MemoryTransport
from schemas import lambda_events
from tests.support.lambda_tasks import InProcessLambda, big_task, capture, code_zip, cora, create_function, \
    invoke_response, results

BUCKET = "dorylus-payloads"


class RunsHandler:
    """A Stubber expected-parameter that checks the event and fills the stubbed response by running the handler
    on it (so the response is the real one for the request actually sent)."""

    def __init__(self, response: dict, check=None):
        self.response, self.check, self.events = response, check, []

    def __eq__(self, payload):
        event = json.loads(payload)
        self.events.append(event)
        if self.check:
            self.check(event)
        fresh = invoke_response(LH.handler(event), billed_ms=42)
        self.response.update(fresh)
        return True

    def __ne__(self, other):
        return not self.__eq__(other)

    def __repr__(self):
        return "<runs the handler>"


def _pool(transport, spec, weights, lam, s3=None, bucket=None, sleeps=None, **kw):
    pool = AwsLambdaPool(transport, spec, function="dorylus-tensor", bucket=bucket, concurrency=1,
                         lambda_client=lam, s3_client=s3, sleep=(sleeps.append if sleeps is not None else
                                                                 (lambda s: None)), **kw)
    for v, flat in weights.items():
        pool.weights.put(Message("WEIGHTS", -1, -1, -1, -1, v, arrays=flat))
    return pool


def _grads(transport):
    return transport.consumer([(M.GRADS, 0)], group=f"g-{id(object())}").poll(0.1)


@pytest.fixture
def lam(aws_env):
    return boto3.client("lambda", region_name="us-east-1")


def _task(kind="LAST"):
    tasks, weights, _ = capture("gcn", "ga-first")
    return tasks[kind][1], weights


# ----------------------------------------------------------------------------------------------- Stubber
def test_request_shape_result_and_billing(lam):
    msg, weights = _task("LAST")
    t = MemoryTransport()
    pool = _pool(t, msg.meta["model"], weights, lam)

    def check(event):
        assert event["event_version"] == lambda_events.EVENT_VERSION and event["task"] == "LAST"
        assert set(event) == {"event_version", "task", "input", "weights", "output"}
        assert set(event["input"]) == {"inline"} and set(event["weights"]) == {"inline"}
        assert event["output"] == {"inline_limit": pool.invoke_limit, "compression": "zstd"}

    response = invoke_response({"ok": True})
    matcher = RunsHandler(response, check)
    with Stubber(lam) as stub:
        stub.add_response("invoke", response, {"FunctionName": "dorylus-tensor",
                                               "InvocationType": "RequestResponse", "LogType": "Tail",
                                               "Payload": matcher})
        pool.run_task(msg)
        stub.assert_no_pending_responses()
    (reply,) = results(t, msg.partition)
    ref, ref_grads = execute(models.from_spec(msg.meta["model"]), msg, unflatten(weights[msg.version]))
    assert reply.kind == "LAST" and reply.key == msg.key
    np.testing.assert_allclose(reply.arrays["dh"], ref.arrays["dh"], atol=1e-6)
    for k in ("loss_sum", "count", "correct"):
        assert reply.meta[k] == pytest.approx(ref.meta[k], abs=1e-6)
    grads = {k: v for g in _grads(t) for k, v in g.arrays.items()}
    assert sorted(grads) == sorted(ref_grads)
    st = pool.stats()
    assert st["invocations"] == 1 and st["billed_ms"] == 42 and st["memory_mb"] == 3008
    assert st["retries"] == 0 and st["bytes_sent"] > 0 and st["bytes_received"] > 0
    # a relaunched duplicate of a task that already succeeded is not invoked again (Stubber has nothing queued)
    with Stubber(lam):
        pool.run_task(msg.replace(meta={**msg.meta, "attempt": 1}))
    assert pool.stats()["duplicates_skipped"] == 1 and pool.stats()["invocations"] == 1


def test_s3_offload_above_6mb(lam):
    msg, weights, model, params = big_task()
    with mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket=BUCKET)
        t = MemoryTransport()
        pool = _pool(t, msg.meta["model"], weights, lam, s3=s3, bucket=BUCKET, compression=None, run_id="r1")

        def check(event):
            assert set(event["input"]) == {"s3"} and event["input"]["s3"]["bucket"] == BUCKET
            key = event["input"]["s3"]["key"]
            assert key.startswith("tensor-workers/r1/in/AV-e0-s1-i0-p0-a0-")
            assert s3.head_object(Bucket=BUCKET, Key=key)["ContentLength"] > lambda_events.INVOKE_LIMIT_BYTES
            assert set(event["weights"]) == {"s3"}
            assert event["weights"]["s3"]["key"] == "tensor-workers/r1/weights/v0.arrow"
            assert event["output"]["s3"]["prefix"].startswith("tensor-workers/r1/out/AV-e0-s1-i0-p0-a0-")
            assert len(json.dumps(event)) < 2000

        response = invoke_response({"ok": True})
        matcher = RunsHandler(response, check)
        with Stubber(lam) as stub:
            stub.add_response("invoke", response, {"FunctionName": ANY, "InvocationType": ANY, "LogType": ANY,
                                                   "Payload": matcher})
            pool.run_task(msg)
            stub.assert_no_pending_responses()
        (reply,) = results(t, 0)
        assert reply.kind == "AV", reply.meta.get("error")
        ref, _ = execute(model, msg, params)
        np.testing.assert_allclose(reply.arrays["h"], ref.arrays["h"], atol=1e-6)
        st = pool.stats()
        # PUT input + PUT weights (client), PUT result (function); GET input + weights (function), GET result
        assert st["s3_puts"] == 3 and st["s3_gets"] == 3, st
        left = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET).get("Contents", [])]
        assert left == ["tensor-workers/r1/weights/v0.arrow"]  # task input and output are deleted after use
        pool.stop()
        assert s3.list_objects_v2(Bucket=BUCKET).get("KeyCount", 0) == 0


def test_oversized_payload_without_bucket_is_a_clear_error(lam):
    msg, weights, _, _ = big_task()
    t = MemoryTransport()
    pool = _pool(t, msg.meta["model"], weights, lam, compression=None)
    with Stubber(lam) as stub:  # nothing queued: any invoke would fail the test
        pool.run_task(msg)
        pool.run_task(msg.replace(interval=1))
        stub.assert_no_pending_responses()
    r1, r2 = results(t, 0)
    assert r1.kind == "ERROR" and r1.meta["retryable"] is False and r1.meta["error_type"] == "PayloadTooLarge"
    assert "no S3 bucket is configured (--bucket)" in r1.meta["error"] and "6291456-byte" in r1.meta["error"]
    assert r2.kind == "ERROR" and "PayloadTooLarge" in r2.meta["error"]
    assert "PayloadTooLarge" in str(pool.error) and pool.stats()["invocations"] == 0


def test_throttling_is_retried_with_capped_backoff(lam):
    msg, weights = _task("AV")
    t = MemoryTransport()
    sleeps = []
    pool = _pool(t, msg.meta["model"], weights, lam, sleeps=sleeps, backoff_s=0.2, backoff_cap_s=0.3)
    response = invoke_response({"ok": True})
    with Stubber(lam) as stub:
        for _ in range(3):
            stub.add_client_error("invoke", "TooManyRequestsException", "Rate exceeded", 429)
        stub.add_response("invoke", response, {"FunctionName": ANY, "InvocationType": ANY, "LogType": ANY,
                                               "Payload": RunsHandler(response)})
        pool.run_task(msg)
        stub.assert_no_pending_responses()
    (reply,) = results(t, msg.partition)
    assert reply.kind == "AV"
    assert len(sleeps) == 3 and 0 <= sleeps[0] <= 0.2 and 0 <= sleeps[1] <= 0.3 and 0 <= sleeps[2] <= 0.3
    st = pool.stats()
    assert st["throttled"] == 3 and st["retries"] == 3 and st["invocations"] == 1


def test_throttling_gives_up_after_bounded_retries(lam):
    msg, weights = _task("AV")
    t = MemoryTransport()
    sleeps = []
    pool = _pool(t, msg.meta["model"], weights, lam, sleeps=sleeps, max_retries=2)
    with Stubber(lam) as stub:
        for _ in range(3):
            stub.add_client_error("invoke", "TooManyRequestsException", "Rate exceeded", 429)
        pool.run_task(msg)  # a 4th call would find the Stubber empty and fail
        stub.assert_no_pending_responses()
    (reply,) = results(t, msg.partition)
    assert reply.kind == "ERROR" and reply.meta["retryable"] is False
    assert reply.meta["error_type"] == "RetriesExhausted" and "3 attempts" in reply.meta["error"]
    assert "TooManyRequestsException" in reply.meta["error"] and len(sleeps) == 2
    assert pool.error is None  # the task failed; the backend is still usable


def test_function_errors_are_retried_then_surfaced(lam):
    msg, weights = _task("AV_BWD")
    t = MemoryTransport()
    pool = _pool(t, msg.meta["model"], weights, lam, max_retries=1)
    crash = {"errorMessage": "2026-01-01 Task timed out after 900.00 seconds", "errorType": "Sandbox.Timedout"}
    with Stubber(lam) as stub:
        stub.add_response("invoke", invoke_response(crash, 900000, function_error="Unhandled"))
        stub.add_response("invoke", invoke_response(crash, 900000, function_error="Unhandled"))
        pool.run_task(msg)
        stub.assert_no_pending_responses()
    (reply,) = results(t, msg.partition)
    assert reply.kind == "ERROR" and "Sandbox.Timedout" in reply.meta["error"] and "timed out" in reply.meta["error"]
    st = pool.stats()
    assert st["function_errors"] == 2 and st["invocations"] == 2 and st["billed_ms"] == 1_800_000


def test_handler_errors_are_surfaced_without_retry(lam):
    msg, weights = _task("AV")
    t = MemoryTransport()
    pool = _pool(t, msg.meta["model"], weights, lam)
    with Stubber(lam) as stub:
        error = lambda_events.error_response("InvalidTask", "AV task: 'h' is wrong")
        stub.add_response("invoke", invoke_response(error))
        pool.run_task(msg)
        stub.assert_no_pending_responses()
    (reply,) = results(t, msg.partition)
    assert reply.kind == "ERROR" and reply.meta["error"] == "InvalidTask: AV task: 'h' is wrong"
    assert reply.meta["retryable"] is False and reply.meta["task"] == "AV"


def test_missing_function_at_invoke_stops_all_invocations(lam):
    msg, weights = _task("AV")
    t = MemoryTransport()
    pool = _pool(t, msg.meta["model"], weights, lam)
    with Stubber(lam) as stub:
        stub.add_client_error("invoke", "ResourceNotFoundException", "Function not found: dorylus-tensor", 404)
        pool.run_task(msg)
        pool.run_task(msg.replace(interval=1))  # not invoked: the first error was fatal
        stub.assert_no_pending_responses()
    r1, r2 = results(t, msg.partition)
    assert "ResourceNotFoundException" in r1.meta["error"] and "Function not found" in r1.meta["error"]
    assert r2.meta["error_type"] == "Aborted"
    assert "ResourceNotFoundException" in str(pool.error)


# ----------------------------------------------------------------------------------------------- moto
def test_setup_checks_missing_function_and_bucket(aws_env):
    spec = capture("gcn", "ga-first")[0]["AV"][0].meta["model"]
    with mock_aws():
        pool = AwsLambdaPool(MemoryTransport(), spec, function="nope", bucket=BUCKET, concurrency=1,
                             region="us-east-1")
        with pytest.raises(AwsSetupError, match="Lambda function 'nope' not found in us-east-1"):
            pool.check()
        create_function("dorylus-tensor", memory=2048)
        pool = AwsLambdaPool(MemoryTransport(), spec, function="dorylus-tensor", bucket=BUCKET, concurrency=1,
                             region="us-east-1")
        with pytest.raises(AwsSetupError, match=f"S3 bucket '{BUCKET}' does not exist"):
            pool.check()
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        pool.check()
        assert pool.memory_mb == 2048  # the function's configured memory, for GB-seconds


def test_setup_checks_credentials_and_region(no_aws_credentials, monkeypatch):
    spec = {"name": "gcn", "in_dim": 4, "hidden": [4], "num_classes": 2, "dropout": 0.5, "order": "auto"}
    pool = AwsLambdaPool(MemoryTransport(), spec, function="f", concurrency=1, region="us-east-1")
    with pytest.raises(AwsSetupError, match="no AWS credentials found"):
        pool.check()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    monkeypatch.delenv("AWS_REGION", raising=False)
    pool = AwsLambdaPool(MemoryTransport(), spec, function="f", concurrency=1)
    with pytest.raises(AwsSetupError, match="no AWS region"):
        pool.check()


def test_lambda_management_create_and_update_code(aws_env, tmp_path):
    """The packaged zip deploys through the Lambda API (moto): create, update the code, read it back."""
    import io
    import zipfile

    with mock_aws():
        first = create_function("dorylus-tensor")
        assert first["Handler"] == "ops.lambda_handler.handler" and first["CodeSize"] == len(code_zip())
        names = zipfile.ZipFile(io.BytesIO(code_zip())).namelist()
        assert "ops/lambda_handler.py" in names and all(n.split("/")[0] in ("ops", "schemas") for n in names)
        lam = boto3.client("lambda")
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            for n in names:
                z.writestr(n, zipfile.ZipFile(io.BytesIO(code_zip())).read(n))
            z.writestr("ops/VERSION", "2")
        upd = lam.update_function_code(FunctionName="dorylus-tensor", ZipFile=buf.getvalue())
        assert upd["CodeSha256"] != first["CodeSha256"]
        got = lam.get_function(FunctionName="dorylus-tensor")
        assert got["Configuration"]["CodeSha256"] == upd["CodeSha256"] and got["Configuration"]["MemorySize"] == 3008


# ----------------------------------------------------------------------------------------------- engine
def test_engine_through_aws_backend_equals_local_pool(aws_env, monkeypatch):
    from pipelines.config import TrainConfig
    from pipelines.engine import aws_lambda
    from pipelines.engine.runner import train_engine

    base = dict(model="gcn", order="ga-first", partitions=2, intervals=2, epochs=3, straggler_min_s=30.0)
    local = train_engine(TrainConfig(**base).resolved(), cora())
    with mock_aws():
        create_function("dorylus-tensor")
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        lam = boto3.client("lambda")
        fake = InProcessLambda(lam, script=["throttle", "crash", "throttle"])
        orig = AwsLambdaPool.from_config

        def from_config(cfg, transport, spec):
            pool = orig(cfg, transport, spec)
            pool.lam, pool.sleep = lam, (lambda s: None)
            return pool

        monkeypatch.setattr(aws_lambda.AwsLambdaPool, "from_config", staticmethod(from_config))
        cfg = TrainConfig(**base, tensor_workers="aws", function="dorylus-tensor", bucket=BUCKET,
                          region="us-east-1", lambda_concurrency=2).resolved()
        remote = train_engine(cfg, cora())
    for a, b in zip(local.history, remote.history):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    for s in local.params:
        for n in local.params[s]:
            np.testing.assert_allclose(remote.params[s][n], local.params[s][n], atol=1e-6)
    st = remote.summary["tensor_pool"]
    assert st["backend"] == "aws" and st["throttled"] == 2 and st["function_errors"] == 1
    assert st["invocations"] == remote.summary["tensor_tasks"] + 1 == fake.calls - 2
    cost = remote.summary["cost"]
    assert cost["usage"]["lambda_invocations"] == st["invocations"] and cost["usage"]["lambda_billed_ms"] > 0
    assert cost["usd"]["lambda_compute"] > 0 and remote.summary["value"] > 0


def test_cli_errors_are_one_line(no_aws_credentials, tmp_path, capsys):
    from pipelines.cli import main

    def run(*args):
        capsys.readouterr()
        code = main(["train", "--dataset", "synthetic:planted?nodes=200&classes=3&features=8", "--partitions", "2",
                     "--epochs", "1", "--quiet", "--out", str(tmp_path / "r"), "--overwrite", *args])
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    r = run("--tensor-workers", "aws")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "dorylus: error: tensor_workers = aws needs a Lambda function (--function NAME)"]
    r = run("--tensor-workers", "aws", "--function", "dorylus-tensor", "--region", "us-east-1")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == ["dorylus: error: no AWS credentials found: set AWS_ACCESS_KEY_ID and "
                                             "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run where an instance role "
                                             "is available"], r.stderr
    r = run("--tensor-workers", "lots")
    assert r.returncode == 2 and "tensor_workers must be an integer >= 1, auto or aws" in r.stderr
