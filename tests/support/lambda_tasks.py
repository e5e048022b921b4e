"""Helpers for the Lambda tests (no tests here): real tensor tasks captured from short Cora runs, AWS fakes.

- `cora()`: the Cora graph (the test skips where the datasets are missing).
- `capture(model, order)`: every tensor task a 2-partition x 2-interval engine run sends, with the weight
  versions it used, captured by wrapping the in-memory transport.
- the fixtures `aws_env` (dummy credentials and region for moto) and `no_aws_credentials` (none at all) are in
  tests/conftest.py.
- `InProcessLambda`: makes a boto3 Lambda client run `ops.lambda_handler.handler` in this process for Invoke
  (moto's Lambda needs Docker to execute code), with an optional script of throttles and crashes.
"""
from __future__ import annotations

import base64
import collections
import functools
import io
import json
import math
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from ops import models
from ops.params import flatten
from schemas.tasks import Channel, Message
from tests.support import datasets_dir


@functools.lru_cache(maxsize=None)
def cora():
    """The Cora graph of the datasets folder (skips the test where it is missing)."""
    from pipelines.data.registry import load_dataset

    data = datasets_dir()
    if not (data / "planetoid").is_dir():
        pytest.skip(f"Cora not found under {data}")
    return load_dataset("cora", str(data))


@functools.lru_cache(maxsize=None)
def capture(model: str, order: str = "auto", epochs: int = 2):
    """({kind: [task Message]}, {version: flat weights}, summary) of a short Cora run."""
    from pipelines.config import TrainConfig
    from pipelines.engine import messages as M
    from pipelines.engine.runner import train_engine
    from pipelines.transports.memory import MemoryTransport

    class Capture(MemoryTransport):
        def __init__(self):
            super().__init__()
            self.tasks = collections.defaultdict(list)
            self.weights = {}

        def send(self, kind, partition, msg):
            if kind == M.TENSOR_TASKS:
                self.tasks[msg.kind].append(msg)
            elif kind == M.WEIGHTS:
                self.weights[msg.version] = dict(msg.arrays)
            super().send(kind, partition, msg)

    t = Capture()
    cfg = TrainConfig(model=model, order=order, partitions=2, intervals=2, epochs=epochs).resolved()
    r = train_engine(cfg, cora(), transport=t)
    return dict(t.tasks), t.weights, r.summary


def create_function(name="dorylus-tensor", memory=3008, zip_bytes: bytes | None = None):
    """A Lambda function in moto (IAM role included); code: the ops+schemas zip unless given."""
    import boto3

    iam = boto3.client("iam")
    try:
        role = iam.get_role(RoleName="dorylus-lambda")["Role"]["Arn"]
    except iam.exceptions.NoSuchEntityException:
        role = iam.create_role(RoleName="dorylus-lambda", AssumeRolePolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {"Service": "lambda.amazonaws.com"},
                                                    "Action": "sts:AssumeRole"}]}))["Role"]["Arn"]
    if zip_bytes is None:
        zip_bytes = code_zip()
    lam = boto3.client("lambda")
    return lam.create_function(FunctionName=name, Runtime="python3.11", Role=role,
                               Handler="ops.lambda_handler.handler", Code={"ZipFile": zip_bytes},
                               MemorySize=memory, Timeout=900)


@functools.lru_cache(maxsize=None)
def code_zip() -> bytes:
    import tempfile

    from pipelines.lambda_package import build_zip

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "code.zip"
        build_zip(p)
        return p.read_bytes()


class Ctx:
    memory_limit_in_mb = 3008


def invoke_response(resp: dict, billed_ms: int = 10, memory_mb: int = 3008, function_error: str | None = None):
    """What boto3's lambda.invoke returns for a handler response (with a log tail's REPORT line)."""
    from botocore.response import StreamingBody

    data = json.dumps(resp).encode()
    log = (f"START RequestId: 1\nEND RequestId: 1\nREPORT RequestId: 1\tDuration: {billed_ms - 0.5:.2f} ms\t"
           f"Billed Duration: {billed_ms} ms\tMemory Size: {memory_mb} MB\tMax Memory Used: 400 MB\t\n")
    out = {"StatusCode": 200, "ExecutedVersion": "$LATEST", "LogResult": base64.b64encode(log.encode()).decode(),
           "Payload": StreamingBody(io.BytesIO(data), len(data))}
    if function_error:
        out["FunctionError"] = function_error
    return out


class InProcessLambda:
    """Runs the handler in-process for a boto3 Lambda client's Invoke (a before-call hook, as Stubber uses).

    script: per call, None (run the handler), "throttle" (429 TooManyRequestsException) or "crash"
    (FunctionError Unhandled); calls past the script's end run the handler."""

    def __init__(self, client, script=(), memory_mb=3008):
        from ops import lambda_handler as LH

        self.handler = LH.handler
        self.script = list(script)
        self.memory_mb = memory_mb
        self.calls = 0
        self.events = []
        client.meta.events.register_first("before-call.lambda.Invoke", self._call)

    def _call(self, params, model, **kw):
        from botocore.awsrequest import AWSResponse

        self.calls += 1
        action = self.script.pop(0) if self.script else None
        if action == "throttle":
            return AWSResponse("https://lambda", 429, {}, None), {
                "Error": {"Code": "TooManyRequestsException", "Message": "Rate exceeded"},
                "ResponseMetadata": {"HTTPStatusCode": 429}}
        if action == "crash":
            parsed = invoke_response({"errorMessage": "Runtime exited with error: signal: killed",
                                      "errorType": "Runtime.ExitError"}, 3000, self.memory_mb, "Unhandled")
            return AWSResponse("https://lambda", 200, {}, None), parsed
        event = json.loads(params["body"])
        self.events.append(event)
        t0 = time.perf_counter()
        resp = self.handler(event, Ctx())
        ms = max(1, math.ceil((time.perf_counter() - t0) * 1000))
        return AWSResponse("https://lambda", 200, {}, None), invoke_response(resp, ms, self.memory_mb)


def results(transport, partition):
    """The tensor results waiting for a graph server on a transport (a fresh reader)."""
    c = transport.consumer([(Channel.TENSOR_RESULTS, partition)], group=f"t-{id(object())}")
    return c.poll(0.1)


def big_task():
    """An AV task whose event is over 6 MB, whose output and weights are over the inline limits."""
    spec = {"name": "gcn", "in_dim": 1600, "hidden": [2048], "num_classes": 7, "dropout": 0.5, "order": "ga-first"}
    model = models.from_spec(spec)
    params = model.init(jax.random.PRNGKey(0))
    flat = flatten(params)
    R = 1500
    rng = np.random.default_rng(0)
    arrays = {"h": rng.random((R, 1600), dtype=np.float32), "row_gids": np.arange(R, dtype=np.int32)}
    msg = Message("AV", 0, 1, 0, 0, 0, arrays=arrays, meta={"model": spec, "attempt": 0, "seed": 7})
    return msg, {0: flat}, model, params
