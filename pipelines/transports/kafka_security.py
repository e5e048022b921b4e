"""Kafka client security: the TLS and SASL settings every Kafka client of the project uses, from the environment.

The same variables the Terraform deployment sets on every server (infra/terraform/main.tf):

- ``DORYLUS_KAFKA_AUTH``: ``none`` (default: PLAINTEXT), ``tls`` (SSL, no SASL), ``scram`` (SASL/SCRAM, as MSK
  port 9096), ``iam`` (SASL ``AWS_MSK_IAM``, as MSK port 9098: botocore signs with the process's AWS
  credentials and region) or ``plain`` (SASL/PLAIN).
- ``DORYLUS_KAFKA_TLS``: ``1``/``0``: TLS on or off; default on for ``tls``, ``scram`` and ``iam`` (MSK accepts
  nothing else), off for ``plain``. ``0`` with ``scram`` is SASL_PLAINTEXT (a broker inside a trusted network).
- ``DORYLUS_KAFKA_CAFILE``: PEM file of the CA that signed the brokers' certificates (default: the system's
  trust store, which is what MSK's certificates chain to).
- ``DORYLUS_KAFKA_USERNAME`` and ``DORYLUS_KAFKA_PASSWORD``, or ``DORYLUS_KAFKA_SECRET_ARN``: a Secrets Manager
  secret holding ``{"username": ..., "password": ...}`` (the format of MSK's ``AmazonMSK_`` SCRAM secrets),
  read once per process with boto3.
- ``DORYLUS_KAFKA_SCRAM_MECHANISM``: ``SCRAM-SHA-512`` (default, the one MSK supports) or ``SCRAM-SHA-256``.

Secrets stay in the environment: nothing here is written to a run directory or a config file.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from pipelines.transports.base import TransportError

AUTH_MODES = ("none", "tls", "scram", "iam", "plain")
_TLS_BY_DEFAULT = {"none": False, "tls": True, "scram": True, "iam": True, "plain": False}


def client_settings(env: dict | None = None) -> dict:
    """kafka-python keyword arguments (security_protocol, sasl_*, ssl_*) for the environment's settings.

    Raises TransportError naming the variable that is wrong or missing."""
    env = os.environ if env is None else env
    auth = (env.get("DORYLUS_KAFKA_AUTH") or "none").strip().lower()
    if auth not in AUTH_MODES:
        raise TransportError(f"DORYLUS_KAFKA_AUTH={auth!r}: expected one of {', '.join(AUTH_MODES)}")
    tls_flag = (env.get("DORYLUS_KAFKA_TLS") or "").strip().lower()
    if tls_flag in ("", "default"):
        tls = _TLS_BY_DEFAULT[auth]
    elif tls_flag in ("1", "true", "yes", "on"):
        tls = True
    elif tls_flag in ("0", "false", "no", "off"):
        tls = False
    else:
        raise TransportError(f"DORYLUS_KAFKA_TLS={tls_flag!r}: expected 1 or 0")
    if auth == "tls" and not tls:
        raise TransportError("DORYLUS_KAFKA_AUTH=tls with DORYLUS_KAFKA_TLS=0 leaves nothing to do; use none")
    if auth == "iam" and not tls:
        raise TransportError("DORYLUS_KAFKA_AUTH=iam needs TLS (MSK's IAM listener is SASL_SSL)")

    out: dict = {}
    sasl = auth in ("scram", "iam", "plain")
    out["security_protocol"] = ("SASL_SSL" if tls else "SASL_PLAINTEXT") if sasl else ("SSL" if tls else "PLAINTEXT")
    if tls:
        cafile = (env.get("DORYLUS_KAFKA_CAFILE") or "").strip()
        if cafile:
            if not Path(cafile).is_file():
                raise TransportError(f"DORYLUS_KAFKA_CAFILE={cafile}: no such file")
            out["ssl_cafile"] = cafile
    if auth in ("scram", "plain"):
        user, password = _credentials(env)
        if auth == "scram":
            mech = (env.get("DORYLUS_KAFKA_SCRAM_MECHANISM") or "SCRAM-SHA-512").strip().upper()
            if mech not in ("SCRAM-SHA-512", "SCRAM-SHA-256"):
                raise TransportError(f"DORYLUS_KAFKA_SCRAM_MECHANISM={mech!r}: expected SCRAM-SHA-512 or "
                                     f"SCRAM-SHA-256")
        else:
            mech = "PLAIN"
        out.update(sasl_mechanism=mech, sasl_plain_username=user, sasl_plain_password=password)
    elif auth == "iam":
        region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
        if not region:
            raise TransportError("DORYLUS_KAFKA_AUTH=iam needs the cluster's region in AWS_REGION or "
                                 "AWS_DEFAULT_REGION")
        out["sasl_mechanism"] = "AWS_MSK_IAM"
    return out


def describe(settings: dict) -> str:
    """One line for logs: protocol and mechanism, never the secret."""
    mech = settings.get("sasl_mechanism")
    return settings.get("security_protocol", "PLAINTEXT") + (f" {mech}" if mech else "") + (
        f" as {settings['sasl_plain_username']}" if settings.get("sasl_plain_username") else "")


def _credentials(env) -> tuple[str, str]:
    user, password = env.get("DORYLUS_KAFKA_USERNAME"), env.get("DORYLUS_KAFKA_PASSWORD")
    if user and password:
        return user, password
    arn = (env.get("DORYLUS_KAFKA_SECRET_ARN") or "").strip()
    if arn:
        return _secret(arn, env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"))
    raise TransportError(f"DORYLUS_KAFKA_AUTH={env.get('DORYLUS_KAFKA_AUTH')} needs DORYLUS_KAFKA_USERNAME and "
                         f"DORYLUS_KAFKA_PASSWORD, or DORYLUS_KAFKA_SECRET_ARN")


@functools.lru_cache(maxsize=8)
def _secret(arn: str, region: str | None) -> tuple[str, str]:
    try:
        import boto3
        import botocore.exceptions
    except ModuleNotFoundError:
        raise TransportError("DORYLUS_KAFKA_SECRET_ARN needs boto3 (pip install 'dorylus[aws]')") from None
    try:
        value = boto3.client("secretsmanager", region_name=region).get_secret_value(SecretId=arn)["SecretString"]
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
        raise TransportError(f"DORYLUS_KAFKA_SECRET_ARN={arn}: cannot read the secret: {e}") from None
    try:
        doc = json.loads(value)
        return str(doc["username"]), str(doc["password"])
    except (ValueError, KeyError, TypeError):
        raise TransportError(f"DORYLUS_KAFKA_SECRET_ARN={arn}: the secret is not JSON with \"username\" and "
                             f"\"password\" (the format of MSK SCRAM secrets)") from None
