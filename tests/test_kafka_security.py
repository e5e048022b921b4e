"""Kafka client security from the environment: TLS and SASL settings, MSK SCRAM secrets, clear errors."""
import json
import time

import pytest

from pipelines.transports.base import TransportError
from pipelines.transports.kafka_security import client_settings, describe


def test_no_settings_is_plaintext():
    assert client_settings({}) == {"security_protocol": "PLAINTEXT"}
    assert describe(client_settings({})) == "PLAINTEXT"


def test_scram_is_sasl_ssl_sha512_like_msk(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    env = {"DORYLUS_KAFKA_AUTH": "scram", "DORYLUS_KAFKA_USERNAME": "u", "DORYLUS_KAFKA_PASSWORD": "p",
           "DORYLUS_KAFKA_CAFILE": str(ca)}
    s = client_settings(env)
    assert s == {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "u",
                 "sasl_plain_password": "p", "ssl_cafile": str(ca)}
    assert "p" not in describe(s).split() and describe(s) == "SASL_SSL SCRAM-SHA-512 as u"
    assert client_settings({**env, "DORYLUS_KAFKA_TLS": "0"})["security_protocol"] == "SASL_PLAINTEXT"
    assert client_settings({**env, "DORYLUS_KAFKA_SCRAM_MECHANISM": "scram-sha-256"})["sasl_mechanism"] == \
        "SCRAM-SHA-256"


def test_tls_and_iam_and_plain():
    assert client_settings({"DORYLUS_KAFKA_AUTH": "tls"}) == {"security_protocol": "SSL"}
    iam = client_settings({"DORYLUS_KAFKA_AUTH": "IAM", "AWS_REGION": "us-east-1"})
    assert iam == {"security_protocol": "SASL_SSL", "sasl_mechanism": "AWS_MSK_IAM"}
    plain = client_settings({"DORYLUS_KAFKA_AUTH": "plain", "DORYLUS_KAFKA_USERNAME": "a",
                             "DORYLUS_KAFKA_PASSWORD": "b"})
    assert plain["security_protocol"] == "SASL_PLAINTEXT" and plain["sasl_mechanism"] == "PLAIN"


@pytest.mark.parametrize("env, needle", [
    ({"DORYLUS_KAFKA_AUTH": "kerberos"}, "DORYLUS_KAFKA_AUTH='kerberos'"),
    ({"DORYLUS_KAFKA_AUTH": "scram"}, "DORYLUS_KAFKA_USERNAME"),
    ({"DORYLUS_KAFKA_AUTH": "scram", "DORYLUS_KAFKA_USERNAME": "u"}, "DORYLUS_KAFKA_SECRET_ARN"),
    ({"DORYLUS_KAFKA_AUTH": "iam"}, "AWS_REGION"),
    ({"DORYLUS_KAFKA_AUTH": "iam", "AWS_REGION": "x", "DORYLUS_KAFKA_TLS": "0"}, "needs TLS"),
    ({"DORYLUS_KAFKA_AUTH": "tls", "DORYLUS_KAFKA_TLS": "maybe"}, "DORYLUS_KAFKA_TLS='maybe'"),
    ({"DORYLUS_KAFKA_AUTH": "tls", "DORYLUS_KAFKA_CAFILE": "/nonexistent/ca.pem"}, "/nonexistent/ca.pem"),
    ({"DORYLUS_KAFKA_AUTH": "scram", "DORYLUS_KAFKA_USERNAME": "u", "DORYLUS_KAFKA_PASSWORD": "p",
      "DORYLUS_KAFKA_SCRAM_MECHANISM": "MD5"}, "DORYLUS_KAFKA_SCRAM_MECHANISM"),
])
def test_wrong_settings_name_the_variable(env, needle):
    with pytest.raises(TransportError, match=None) as e:
        client_settings(env)
    assert needle in str(e.value)


def test_scram_credentials_from_an_msk_secret():
    moto = pytest.importorskip("moto")
    import boto3

    with moto.mock_aws():
        sm = boto3.client("secretsmanager", region_name="us-east-1")
        arn = sm.create_secret(Name="AmazonMSK_dorylus", SecretString=json.dumps(
            {"username": "alice", "password": "s3cret"}))["ARN"]
        bad = sm.create_secret(Name="AmazonMSK_bad", SecretString="alice:s3cret")["ARN"]
        env = {"DORYLUS_KAFKA_AUTH": "scram", "DORYLUS_KAFKA_SECRET_ARN": arn, "AWS_REGION": "us-east-1"}
        s = client_settings(env)
        assert (s["sasl_plain_username"], s["sasl_plain_password"]) == ("alice", "s3cret")
        with pytest.raises(TransportError, match="not JSON"):
            client_settings({**env, "DORYLUS_KAFKA_SECRET_ARN": bad})
        with pytest.raises(TransportError, match="cannot read the secret"):
            client_settings({**env, "DORYLUS_KAFKA_SECRET_ARN": arn.replace("dorylus", "missing")})


# ------------------------------------------------------------------------------ against a SASL_SSL/SCRAM broker
def _scram_env(broker: dict, password: str | None = None) -> dict:
    return {"DORYLUS_KAFKA_AUTH": "scram", "DORYLUS_KAFKA_USERNAME": broker["username"],
            "DORYLUS_KAFKA_PASSWORD": password or broker["password"], "DORYLUS_KAFKA_CAFILE": broker["cafile"]}


@pytest.mark.kafka
def test_transport_channels_over_sasl_ssl_scram(kafka_scram, monkeypatch):
    pytest.importorskip("kafka")
    import uuid

    import numpy as np

    from pipelines.engine import messages as M
    from pipelines.engine.messages import Message
    from pipelines.transports.kafka import KafkaTransport

    for k, v in _scram_env(kafka_scram).items():
        monkeypatch.setenv(k, v)
    t = KafkaTransport(kafka_scram["bootstrap"], f"sec-{uuid.uuid4().hex[:8]}", 2)
    try:
        assert t.security["security_protocol"] == "SASL_SSL"
        for i in range(3):
            t.send(M.GHOSTS, 1, Message("SC", i, 0, -1, 1, -1, arrays={"h": np.full((2, 3), i, np.float32),
                                                                       "vertex": np.arange(2)}, meta={"name": "h"}))
        t.flush()
        c = t.consumer([(M.GHOSTS, 1)], group="g")
        got, deadline = [], time.monotonic() + 30
        while len(got) < 3 and time.monotonic() < deadline:
            got += c.poll(0.2)
            c.commit()
        assert [m.epoch for m in got] == [0, 1, 2]
        np.testing.assert_array_equal(got[2].arrays["h"], np.full((2, 3), 2, np.float32))
    finally:
        t.close()


@pytest.mark.kafka
def test_spawn_local_training_over_sasl_ssl_scram_and_a_wrong_password(kafka_scram, data_dir, tmp_path):
    """Every role process inherits the settings; a wrong password is one line and exit 2, nothing written."""
    pytest.importorskip("kafka")
    import os
    import subprocess
    import sys
    import uuid

    def train(out, env_extra):
        argv = [sys.executable, "-m", "pipelines.cli", "train", "--dataset", "cora", "--data-dir", str(data_dir),
                "--model", "gcn", "--partitions", "2", "--intervals", "2", "--epochs", "3", "--patience", "0",
                "--transport", "kafka", "--bootstrap", kafka_scram["bootstrap"], "--spawn-local",
                "--run-id", f"scram-{uuid.uuid4().hex[:8]}", "--out", str(out), "--quiet"]
        return subprocess.run(argv, capture_output=True, text=True, timeout=600,
                              env={**os.environ, **env_extra})

    out = tmp_path / "run"
    proc = train(out, _scram_env(kafka_scram))
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "complete" and s["epochs"] == 3
    assert "SASL_SSL SCRAM-SHA-512" in (out / "logs" / "graph-server-0.log").read_text()

    bad = tmp_path / "bad"
    proc = train(bad, _scram_env(kafka_scram, password="not-the-password"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "SASL_SSL SCRAM-SHA-512" in lines[0] and "not-the-password" not in lines[0]
    assert not bad.exists()
