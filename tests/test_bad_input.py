"""The bad-input catalogue: every input a user or a peer can get wrong, one table row each.

Commands (`dorylus train`, `prepare`, `infer`, `stream`, `deploy render`, config files, prepared directories) must
end with one line on stderr naming the problem, exit code 2, and no output left behind. Peer input (Kafka values
on every engine topic, events on the stream's topic, Lambda events) must become a dead letter or a structured
error, never reach the engine. Commands run in-process through `pipelines.cli.main`, so the module stays fast.
"""
from __future__ import annotations

import collections
import json
import shutil
import threading
from pathlib import Path
from typing import Callable, NamedTuple

import apache_beam  # noqa: F401  (imported up front: its import-time log line is not a command's stderr)
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ops import lambda_handler as LH
from ops import models
from pipelines.cli import main
from pipelines.config import TrainConfig
from pipelines.continuous.stream import Stream, StreamOptions
from pipelines.engine.messages import Message
from pipelines.transports import codec
from pipelines.transports.kafka import KafkaTransport, topic_name
from schemas import lambda_events
from schemas import messages as S
from schemas.events import encode_events, events_batch
from tests.support import SUMMARY_LINE, ConsumedRecord
from tests.support.ogb import write_ogb

N, CLASSES, F = 90, 3, 5


# ------------------------------------------------------------------------------------------------ the workspace
def _graph_files(d: Path, stem: str, *, edges=None, labels=None, features=None, split=None) -> Path:
    rng = np.random.default_rng(0)
    if edges is None:
        e = rng.integers(0, N, (300, 2))
        edges = "src,dst\n" + "".join(f"{a},{b}\n" for a, b in e)
    (d / f"{stem}.csv").write_text(edges)
    np.save(d / f"{stem}.labels.npy", np.arange(N) % CLASSES if labels is None else labels)
    np.save(d / f"{stem}.features.npy", rng.random((N, F)).astype(np.float32) if features is None else features)
    np.save(d / f"{stem}.split.npy", _split() if split is None else split)
    return d / f"{stem}.csv"


def _split(no_test=False, drop_train_class=None):
    """Per class: 5 train, 5 val, the rest test (or none)."""
    s = np.full(N, 2 if not no_test else -1, np.int8)
    y = np.arange(N) % CLASSES
    for c in range(CLASSES):
        idx = np.flatnonzero(y == c)
        s[idx[:5]] = 0 if c != drop_train_class else 1
        s[idx[5:10]] = 1
    return s


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """Good and bad inputs of every kind, a prepared graph (with and without a split) and a trained run."""
    d = tmp_path_factory.mktemp("bad-input")
    g = _graph_files(d, "g")
    _graph_files(d, "badline", edges="0,1\n1,x\n")
    _graph_files(d, "threecols", edges="0,1\n1,2,3\n")
    _graph_files(d, "oor", edges="0,1\n1,500\n")
    nan = np.ones((N, F), np.float32)
    nan[7, 2] = np.nan
    _graph_files(d, "nanfeat", features=nan)
    _graph_files(d, "widefeat", features=np.ones((N + 1, F), np.float32))
    _graph_files(d, "badsplit", split=np.full(N, 7, np.int8))
    _graph_files(d, "notest", split=_split(no_test=True))
    _graph_files(d, "noclass", split=_split(drop_train_class=2))
    labels = np.arange(N) % CLASSES
    labels[0] = -5
    _graph_files(d, "badlabel", labels=labels, split=np.where(np.arange(N) == 0, -1, _split()))
    (d / "nolabels.csv").write_text("0,1\n")
    np.save(d / "x.npy", np.load(d / "g.features.npy"))
    np.save(d / "y.npy", np.load(d / "g.labels.npy"))
    np.save(d / "split.npy", _split())
    np.save(d / "x_nan.npy", nan)
    np.save(d / "x_rows.npy", np.ones((N - 3, F), np.float32))
    np.save(d / "split_short.npy", _split()[:-4])
    (d / "bad.csv").write_text("0,1\n1,x\n")
    (d / "oor.txt").write_text("0 1\n1 500\n")
    base = ["prepare", "--edges", str(g), "--features", str(d / "x.npy"), "--labels", str(d / "y.npy"),
            "--partitions", "2"]
    assert main(base + ["--split-file", str(d / "split.npy"), "--out", str(d / "prep")]) == 0
    assert main(base + ["--out", str(d / "prep-nosplit")]) == 0
    assert main(["train", "--dataset", str(g), "--epochs", "2", "--hidden", "4", "--quiet",
                 "--out", str(d / "run")]) == 0
    run_nw = d / "run-noweights"
    run_nw.mkdir()
    shutil.copy(d / "run" / "config.toml", run_nw / "config.toml")
    run_badw = d / "run-badweights"
    run_badw.mkdir()
    shutil.copy(d / "run" / "config.toml", run_badw / "config.toml")
    (run_badw / "weights.npz").write_bytes(b"not a zip")
    ogb = write_ogb(d / "ogbn_bad", _load(str(g)))
    (ogb / "raw" / "node-feat.csv.gz").unlink()
    (d / "full").mkdir()
    (d / "full" / "keep.txt").write_text("someone's file\n")
    return d


def _load(spec):
    from pipelines.data.registry import load_dataset

    return load_dataset(spec)


# ------------------------------------------------------------------------------------------------ command cases
class Cmd(NamedTuple):
    """argv (with {ws} and {out} filled in), the regex the one error line must contain, and the exit code."""

    argv: str
    needle: str
    config: str | None = None     # TOML text written to {cfg} first
    code: int = 2
    warns: bool = False           # a warning and exit 0 instead of an error


TRAIN = "train --epochs 2 --quiet --out {out}"
DEPLOYABLE = 'dataset = "cora"\npartitions = 2\n'

DS = "--dataset {ws}/g.csv"
CMD_CASES = {
    # dorylus train: datasets
    "train-unknown-dataset": Cmd(f"{TRAIN} --dataset ogbn-nope", r"unknown dataset 'ogbn-nope'"),
    "train-missing-dataset-file": Cmd(f"{TRAIN} --dataset {{ws}}/nope.csv", r"missing edge-list file"),
    "train-edge-list-without-labels": Cmd(f"{TRAIN} --dataset {{ws}}/nolabels.csv", r"labels are required"),
    "train-edge-list-bad-line": Cmd(f"{TRAIN} --dataset {{ws}}/badline.csv", r"badline\.csv:2: node id 'x'"),
    "train-edge-list-three-columns": Cmd(f"{TRAIN} --dataset {{ws}}/threecols.csv", r"threecols\.csv:2: expected 2"),
    "train-edge-id-out-of-range": Cmd(f"{TRAIN} --dataset {{ws}}/oor.csv", r"edge endpoint id 500 is out of range"),
    "train-nan-features": Cmd(f"{TRAIN} --dataset {{ws}}/nanfeat.csv", r"NaN or inf \(first at node 7\)"),
    "train-feature-rows-mismatch": Cmd(f"{TRAIN} --dataset {{ws}}/widefeat.csv", r"does not match feature rows 91"),
    "train-bad-split-values": Cmd(f"{TRAIN} --dataset {{ws}}/badsplit.csv", r"split values must be -1, 0"),
    "train-label-out-of-range": Cmd(f"{TRAIN} --dataset {{ws}}/badlabel.csv",
                                    r"labels must lie in \[-1, 3\), found \[-5, 2\]"),
    "train-no-test-vertices": Cmd(f"{TRAIN} --dataset {{ws}}/notest.csv", r"has no test vertices \(15 training"),
    "train-class-without-training-vertices": Cmd(f"{TRAIN} --dataset {{ws}}/noclass.csv",
                                                 r"warning: .*class\(es\) 2 have no training vertex", code=0,
                                                 warns=True),
    "train-unknown-synthetic-parameter": Cmd(f"{TRAIN} --dataset synthetic:planted?bogus=1", r"unknown parameter"),
    "train-synthetic-not-a-number": Cmd(f"{TRAIN} --dataset synthetic:rmat?scale=x", r"not a number"),
    "train-ogb-missing-file": Cmd(f"{TRAIN} --dataset {{ws}}/ogbn_bad", r"missing node feature file"),
    "train-directory-not-a-dataset": Cmd(f"{TRAIN} --dataset {{ws}}/full", r"not an OGB node-property dataset"),
    # dorylus train: flags
    "train-epochs-zero": Cmd(f"{TRAIN} {DS} --epochs 0", r"epochs must be >= 1"),
    "train-lr-negative": Cmd(f"{TRAIN} {DS} --lr -1", r"lr must be > 0"),
    "train-dropout-one": Cmd(f"{TRAIN} {DS} --dropout 1", r"dropout must be in \[0, 1\)"),
    "train-hidden-zero": Cmd(f"{TRAIN} {DS} --hidden 0", r"hidden must be >= 1"),
    "train-layers-zero": Cmd(f"{TRAIN} {DS} --layers 0", r"layers must be >= 1"),
    "train-weight-decay-negative": Cmd(f"{TRAIN} {DS} --weight-decay -0.1", r"weight_decay must be >= 0"),
    "train-patience-negative": Cmd(f"{TRAIN} {DS} --patience -1", r"patience must be >= 0"),
    "train-epochs-not-a-number": Cmd(f"{TRAIN} {DS} --epochs many", r"--epochs: invalid int value"),
    "train-unknown-model": Cmd(f"{TRAIN} {DS} --model mlp", r"--model: invalid choice: 'mlp'"),
    "train-unknown-order": Cmd(f"{TRAIN} {DS} --order sideways", r"--order: invalid choice"),
    "train-unknown-flag": Cmd(f"{TRAIN} {DS} --frobnicate", r"unrecognized arguments: --frobnicate"),
    "train-staleness-negative": Cmd(f"{TRAIN} {DS} --partitions 2 --staleness -1", r"staleness"),
    "train-staleness-word": Cmd(f"{TRAIN} {DS} --partitions 2 --staleness lots", r"staleness"),
    "train-sync-warmup-negative": Cmd(f"{TRAIN} {DS} --partitions 2 --staleness 1 --sync-warmup -3",
                                      r"sync_warmup must be an integer >= 0"),
    "train-wire-dtype-unknown": Cmd(f"{TRAIN} {DS} --partitions 2 --wire-dtype float16",
                                    r"--wire-dtype: invalid choice: 'float16'"),
    "train-residual-cache-negative": Cmd(f"{TRAIN} {DS} --partitions 2 --residual-cache-mb -1",
                                         r"residual_cache_mb must be an integer >= 0"),
    "train-partitions-zero": Cmd(f"{TRAIN} {DS} --partitions 0", r"partitions must be >= 1"),
    "train-partitions-beyond-vertices": Cmd(f"{TRAIN} {DS} --partitions 500",
                                            r"partitions \(500\) exceeds the graph's 90 vertices"),
    "train-intervals-beyond-partition": Cmd(f"{TRAIN} {DS} --partitions 2 --intervals 80",
                                            r"intervals \(80\) exceeds the smallest partition"),
    "train-tensor-workers-zero": Cmd(f"{TRAIN} {DS} --partitions 2 --tensor-workers 0", r"tensor_workers"),
    "train-aws-without-function": Cmd(f"{TRAIN} {DS} --partitions 2 --tensor-workers aws", r"function"),
    "train-cpu-only-with-aws": Cmd(f"{TRAIN} {DS} --partitions 2 --mode cpu-only --tensor-workers aws "
                                   f"--function f", r"cpu-only"),
    "train-spawn-local-without-kafka": Cmd(f"{TRAIN} {DS} --spawn-local", r"--spawn-local .* --transport kafka"),
    "train-fail-rate-above-one": Cmd(f"{TRAIN} {DS} --partitions 2 --fail-rate 2", r"fail_rate"),
    "train-lr-infinite": Cmd(f"{TRAIN} {DS} --lr inf", r"lr must be a finite number, got inf"),
    "train-weight-decay-infinite": Cmd(f"{TRAIN} {DS} --weight-decay inf", r"weight_decay must be a finite number"),
    # an infinite latency used to hang the engine at its first tensor task
    "train-task-latency-infinite": Cmd(f"{TRAIN} {DS} --partitions 2 --task-latency-s inf",
                                       r"task_latency_s must be a finite number"),
    "train-delay-not-a-number": Cmd(f"{TRAIN} {DS} --partitions 2 --delay-rate 1 --delay-s nan",
                                    r"delay_s must be a finite number, got nan"),
    "train-straggler-min-negative": Cmd(f"{TRAIN} {DS} --partitions 2 --straggler-min-s -1",
                                        r"straggler_min_s must be >= 0"),
    "train-worker-processes-zero": Cmd(f"{TRAIN} {DS} --worker-processes 0", r"--worker-processes must be >= 1"),
    "train-prices-missing": Cmd(f"{TRAIN} {DS} --prices {{ws}}/nope.toml", r"nope\.toml"),
    "train-partitioner-prepared-without-prepared": Cmd(f"{TRAIN} {DS} --partitions 2 --partitioner prepared",
                                                       r"partitioner must be metis or hash"),
    "train-prepared-and-dataset": Cmd(f"{TRAIN} {DS} --prepared {{ws}}/prep", r"exclude each other"),
    "train-resume-missing-run": Cmd("train --resume {ws}/nope-run", r"nope-run"),
    "train-out-not-empty": Cmd(f"train {DS} --epochs 2 --quiet --out {{ws}}/full", r"full"),
    # config files
    "config-missing": Cmd(f"{TRAIN} --config {{ws}}/nope.toml", r"nope\.toml"),
    "config-not-toml": Cmd(f"{TRAIN} --config {{cfg}}", r"c\.toml", config="epochs = = 3\n"),
    "config-unknown-key": Cmd(f"{TRAIN} --config {{cfg}}", r"frobnicate", config="frobnicate = 1\n"),
    "config-wrong-type": Cmd(f"{TRAIN} --config {{cfg}}", r"epochs", config='epochs = "many"\n'),
    "config-unknown-model": Cmd(f"{TRAIN} --config {{cfg}}", r"unknown model 'mlp'", config='model = "mlp"\n'),
    "config-table-instead-of-value": Cmd(f"{TRAIN} --config {{cfg}}", r"lr", config="[lr]\nvalue = 1\n"),
    "config-bad-value": Cmd(f"{TRAIN} --config {{cfg}}", r"wu must be sync or async", config='wu = "bulk"\n'),
    # prepared directories (see PREPARED_CASES for broken ones)
    "train-prepared-missing": Cmd(f"{TRAIN} --prepared {{ws}}/nope-prep", r"no manifest\.json"),
    "train-prepared-without-split": Cmd(f"{TRAIN} --prepared {{ws}}/prep-nosplit",
                                        r"has no training and no validation and no test vertices"),
    "train-prepared-partitioner-mismatch": Cmd(f"{TRAIN} --prepared {{ws}}/prep --partitions 3 "
                                               f"--partitioner prepared", r"holds 2 partitions, not 3"),
    # dorylus prepare
    "prepare-missing-edges": Cmd("prepare --edges {ws}/nope-*.csv --labels {ws}/y.npy --out {out}", r"nope"),
    "prepare-bad-line": Cmd("prepare --edges {ws}/bad.csv --labels {ws}/y.npy --out {out}",
                            r"bad\.csv:2: non-integer field 'x'"),
    "prepare-ids-out-of-range": Cmd("prepare --edges {ws}/oor.txt --labels {ws}/y.npy --out {out}", r"500"),
    "prepare-nan-features": Cmd("prepare --edges {ws}/g.csv --features {ws}/x_nan.npy --labels {ws}/y.npy "
                                "--out {out}", r"NaN|finite"),
    "prepare-feature-rows": Cmd("prepare --edges {ws}/g.csv --features {ws}/x_rows.npy --labels {ws}/y.npy "
                                "--out {out}", r"87|rows"),
    "prepare-split-without-labels": Cmd("prepare --edges {ws}/g.csv --split --out {out}", r"--split needs --labels"),
    "prepare-split-and-split-file": Cmd("prepare --edges {ws}/g.csv --labels {ws}/y.npy --split --split-file "
                                        "{ws}/split.npy --out {out}", r"exclude each other"),
    "prepare-split-file-short": Cmd("prepare --edges {ws}/g.csv --labels {ws}/y.npy --split-file "
                                    "{ws}/split_short.npy --out {out}", r"86|entries|rows"),
    "prepare-partitions-zero": Cmd("prepare --edges {ws}/g.csv --labels {ws}/y.npy --partitions 0 --out {out}",
                                   r"partitions"),
    "prepare-unknown-flag": Cmd("prepare --edges {ws}/g.csv --frobnicate --out {out}",
                                r"unrecognized arguments: --frobnicate"),
    "prepare-out-not-empty": Cmd("prepare --edges {ws}/g.csv --labels {ws}/y.npy --out {ws}/full", r"full"),
    # dorylus infer
    "infer-run-missing": Cmd("infer --run {ws}/nope-run --prepared {ws}/prep --out {out}", r"no config\.toml"),
    "infer-run-without-weights": Cmd("infer --run {ws}/run-noweights --prepared {ws}/prep --out {out}",
                                     r"weights\.npz"),
    "infer-weights-not-npz": Cmd("infer --run {ws}/run-badweights --prepared {ws}/prep --out {out}",
                                 r"weights\.npz"),
    "infer-weights-do-not-fit": Cmd("infer --run {ws}/run --dataset synthetic:planted?nodes=200&classes=3 "
                                    "--out {out}", r"do not fit a gcn with 128 input features"),
    "infer-prepared-missing": Cmd("infer --run {ws}/run --prepared {ws}/nope-prep --out {out}",
                                  r"no manifest\.json"),
    "infer-block-size-zero": Cmd("infer --run {ws}/run --prepared {ws}/prep --block-size 0 --out {out}",
                                 r"block"),
    "infer-prepared-and-dataset": Cmd("infer --run {ws}/run --prepared {ws}/prep --dataset cora --out {out}",
                                      r"not allowed with argument"),
    "infer-unknown-flag": Cmd("infer --run {ws}/run --prepared {ws}/prep --frobnicate 3 --out {out}",
                              r"unrecognized arguments: --frobnicate"),
    "infer-out-not-empty": Cmd("infer --run {ws}/run --prepared {ws}/prep --out {ws}/full", r"full"),
    # dorylus stream (all fail before any broker is contacted)
    "stream-round-interval-zero": Cmd("stream --bootstrap 127.0.0.1:9 --events ev --out {out} --round-interval 0",
                                      r"round-interval must be > 0"),
    "stream-num-classes-one": Cmd("stream --bootstrap 127.0.0.1:9 --events ev --out {out} --num-classes 1",
                                  r"num-classes must be >= 2"),
    "stream-min-train-classes-one": Cmd("stream --bootstrap 127.0.0.1:9 --events ev --out {out} "
                                        "--min-train-classes 1", r"min-train-classes must be >= 2"),
    "stream-missing-events": Cmd("stream --bootstrap 127.0.0.1:9 --out {out}", r"--events"),
    "stream-unknown-model": Cmd("stream --bootstrap 127.0.0.1:9 --events ev --out {out} --model mlp",
                                r"invalid choice: 'mlp'"),
    "stream-bad-config": Cmd("stream --bootstrap 127.0.0.1:9 --events ev --out {out} --config {cfg}",
                             r"frobnicate", config="frobnicate = 2\n"),
    "stream-lr-zero": Cmd("stream --bootstrap 127.0.0.1:9 --events ev --out {out} --lr 0", r"lr must be > 0"),
    "stream-round-interval-infinite": Cmd("stream --bootstrap 127.0.0.1:9 --events ev --out {out} "
                                          "--round-interval inf", r"round-interval must be a finite number"),
    "stream-lateness-not-a-number": Cmd("stream --bootstrap 127.0.0.1:9 --events ev --out {out} "
                                        "--allowed-lateness nan", r"allowed-lateness must be a finite number"),
    # dorylus deploy render
    "deploy-config-missing": Cmd("deploy render --config {ws}/nope.toml --out {out}", r"nope\.toml"),
    "deploy-too-many-partitions": Cmd("deploy render --config {cfg} --out {out}", r"exceeds the deployment",
                                      config='dataset = "cora"\npartitions = 999\n'),
    "deploy-local-dataset-path": Cmd("deploy render --config {cfg} --out {out}", r"is a path on this machine",
                                     config='dataset = "/home/me/g.csv"\npartitions = 2\n'),
    "deploy-prepared": Cmd("deploy render --config {cfg} --out {out}", r"prepared",
                           config='prepared = "/data/prep"\npartitions = 2\n'),
    "deploy-bad-instance-type": Cmd("deploy render --config {cfg} --out {out}", r"not an EC2 instance type",
                                    config=DEPLOYABLE + 'graph_instance = "big"\n'),
    "deploy-bad-name": Cmd("deploy render --config {cfg} --name Bad_Name --out {out}", r"--name 'Bad_Name'",
                           config=DEPLOYABLE),
    "deploy-bad-bootstrap": Cmd("deploy render --config {cfg} --bootstrap nonsense --out {out}", r"--bootstrap",
                                config=DEPLOYABLE),
    "deploy-bad-run-id": Cmd("deploy render --config {cfg} --run-id 'a b' --out {out}", r"--run-id",
                             config=DEPLOYABLE),
    "deploy-lambda-busy-above-one": Cmd("deploy render --config {cfg} --estimate --lambda-busy 2 --out {out}",
                                        r"--lambda-busy must be in \[0, 1\]",
                                        config=DEPLOYABLE),
}


def _argv(template: str, ws: Path, out: Path, cfg: Path) -> list[str]:
    import shlex

    return [a.format(ws=ws, out=out, cfg=cfg) for a in shlex.split(template)]


def _listing(d: Path) -> set:
    return {p.relative_to(d) for p in d.rglob("*")}


@pytest.mark.parametrize("name", list(CMD_CASES))
def test_command(name, ws, tmp_path, capsys):
    case = CMD_CASES[name]
    out, cfg = tmp_path / "out", tmp_path / "c.toml"
    if case.config is not None:
        cfg.write_text(case.config)
    before = _listing(ws)
    capsys.readouterr()
    code = main(_argv(case.argv, ws, out, cfg))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == case.code, (name, code, err)
    assert len(err) == 1, (name, err)
    import re

    assert re.search(case.needle, err[0]), (name, case.needle, err[0])
    if case.warns:
        assert err[0].startswith("dorylus: warning:") and (out / "summary.json").exists()
        return
    assert not out.exists(), (name, sorted(map(str, out.rglob("*"))) if out.exists() else None)
    assert _listing(tmp_path) <= {Path("c.toml")}, (name, _listing(tmp_path))  # no temp siblings left either
    assert _listing(ws) == before, (name, _listing(ws) ^ before)


# ------------------------------------------------------------------------------------------------ prepared dirs
def _manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


def _write_manifest(d: Path, m: dict) -> None:
    (d / "manifest.json").write_text(json.dumps(m))


def _shorter_shard(d: Path) -> None:
    """A vertex shard with a row fewer, the manifest's checksum updated: the row count still disagrees."""
    import hashlib

    m = _manifest(d)
    entry = m["partitions"][0]
    path = d / entry["vertices"]
    t = pq.read_table(path)
    pq.write_table(t.slice(0, t.num_rows - 1), path)
    entry["vertices_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    _write_manifest(d, m)


PREPARED_CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "prepared-no-manifest": (lambda d: (d / "manifest.json").unlink(), r"no manifest\.json"),
    "prepared-manifest-not-json": (lambda d: (d / "manifest.json").write_text("{half"), r"manifest\.json"),
    "prepared-wrong-format": (lambda d: _write_manifest(d, {**_manifest(d), "format": "parquet-dump"}),
                              r"format 'parquet-dump'"),
    "prepared-newer-version": (lambda d: _write_manifest(d, {**_manifest(d), "format_version": 99}),
                               r"format version 99"),
    "prepared-shard-missing": (lambda d: (d / _manifest(d)["partitions"][1]["edges"]).unlink(),
                               r"listed in the manifest but missing"),
    "prepared-shard-changed": (lambda d: (d / _manifest(d)["partitions"][0]["edges"]).write_bytes(b"PAR1 junk"),
                               r"does not match the manifest"),
    "prepared-shard-rows": (_shorter_shard, r"rows, the manifest says"),
}


@pytest.mark.parametrize("name", list(PREPARED_CASES))
@pytest.mark.parametrize("command", ["train", "infer"])
def test_broken_prepared_directory(name, command, ws, tmp_path, capsys):
    breaks, needle = PREPARED_CASES[name]
    prep = tmp_path / "prep"
    shutil.copytree(ws / "prep", prep)
    breaks(prep)
    out = tmp_path / "out"
    argv = (["train", "--prepared", str(prep), "--epochs", "2", "--quiet", "--out", str(out)] if command == "train"
            else ["infer", "--run", str(ws / "run"), "--prepared", str(prep), "--out", str(out)])
    capsys.readouterr()
    code = main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    import re

    assert code == 2 and len(err) == 1 and re.search(needle, err[0]), (name, command, code, err)
    assert not out.exists() and not list(tmp_path.glob("out*"))


# ------------------------------------------------------------------------------------------------ Kafka values
class _Recorder:
    """Where the transport's producer would write: the dead-letter sends, kept for the assertions."""

    def __init__(self):
        self.sent = []

    def send(self, topic, value=None, key=None, headers=None, partition=None):
        self.sent.append((topic, value, dict(headers or [])))


def _decoding_transport(run_id: str) -> KafkaTransport:
    """The Kafka transport's receive path (`decode_records`, dead letters) without a broker behind it."""
    t = KafkaTransport.__new__(KafkaTransport)
    t.run_id = run_id
    t._lock = threading.Lock()
    t._high, t._redelivered, t._consumed = {}, collections.Counter(), collections.Counter()
    t._dead, t._dead_reasons = collections.Counter(), []
    t._producer = _Recorder()
    return t


_H = np.ones((3, 4), np.float32)
TOPIC_MESSAGES = {  # a well-formed message of each engine topic
    "tensor": Message("AV", 1, 0, 0, 1, 1, arrays={"h": _H, "row_gids": np.arange(3, dtype=np.int32)},
                      meta={"seed": 1, "attempt": 0}),
    "tensor.out": Message("AV", 1, 0, 0, 1, 1, arrays={"h": _H}, meta={"busy_s": 0.1}),
    "ghosts": Message("SC", 1, 0, -1, 1, -1, arrays={"h": _H, "vertex": np.arange(3, dtype=np.int64)},
                      meta={"name": "h"}),
    "ghosts.grad": Message("SC_BWD", 1, 0, -1, 0, -1, arrays={"h": _H, "vertex": np.arange(3, dtype=np.int64)},
                           meta={"name": "h"}),
    "watermarks": Message("WM", 1, 2, -1, 1, -1, meta={"dir": "F"}),
    "grads": Message("GRAD", 1, 1, 0, 1, 1, arrays={"av0/w": _H}, meta={"stage_name": "av0"}),
    "weights": Message("WEIGHTS", 1, -1, -1, 0, 2, arrays={"av0/w": _H}, meta={}),
    "metrics": Message("EPOCH", 1, -1, -1, 1, -1, meta={"loss_sum": 1.0, "count": 3.0}),
    "control": Message("STOP_AFTER", 4, -1, -1, 1, -1),
}


def _foreign_arrow() -> bytes:
    sink = pa.BufferOutputStream()
    batch = pa.record_batch([pa.array([1, 2])], names=["x"])
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


KAFKA_CASES: dict[str, tuple[str, Callable[[], bytes | None], str]] = {}
for _kind, _msg in TOPIC_MESSAGES.items():
    KAFKA_CASES[f"{_kind}-another-runs-message"] = (_kind, lambda m=_msg: codec.encode(m, "other-run"),
                                                   r"of run 'other-run' on a channel of run 'run-a'")
    KAFKA_CASES[f"{_kind}-truncated"] = (_kind, lambda m=_msg: codec.encode(m, "run-a")[:-40], r"SchemaError")
KAFKA_CASES.update({
    "tensor-garbage-bytes": ("tensor", lambda: b"\x00garbage\xff" * 10, r"SchemaError"),
    "tensor.out-empty-value": ("tensor.out", lambda: b"", r"SchemaError"),
    "grads-tombstone": ("grads", lambda: None, r"empty value \(a tombstone\)"),
    "weights-foreign-arrow-schema": ("weights", _foreign_arrow, r"SchemaError: .*"),
    "watermarks-unknown-channel": ("watermarks", lambda: S.encode(S.Watermark("run-a", "graph-server-1", 1, 3, 0,
                                                                              "elsewhere")),
                                   r"watermark channel 'elsewhere' is not one the engine uses"),
    "control-without-routing": ("control", lambda: S.encode(S.Control("run-a", "STOP", {"epoch": 1})),
                                r"lacks routing args"),
    "ghosts-edge-block": ("ghosts", lambda: S.encode(S.edge_block("SC", "run-a", 0, 0, -1, 0, np.arange(2),
                                                                  np.arange(2))), r"the engine sends no edge blocks"),
})


def test_kafka_values_are_only_what_they_claim():
    """Sanity: every topic's well-formed message passes the same receive path."""
    t = _decoding_transport("run-a")
    recs = [ConsumedRecord(topic_name("run-a", k), 0, 0, None, codec.encode(m, "run-a")) for k, m in TOPIC_MESSAGES.items()]
    assert len(t.decode_records(recs, "g")) == len(TOPIC_MESSAGES) and not t._producer.sent


@pytest.mark.parametrize("name", list(KAFKA_CASES))
def test_kafka_value_is_a_dead_letter(name, capsys):
    import re

    kind, value, needle = KAFKA_CASES[name]
    t = _decoding_transport("run-a")
    rec = ConsumedRecord(topic_name("run-a", kind), 1, 7, b"k", value())
    assert t.decode_records([rec], "graph-server-1") == []   # nothing reaches the engine
    assert t._dead == {(kind, 1): 1}
    [(topic, sent, headers)] = t._producer.sent
    assert topic == topic_name("run-a", "dead-letter") and sent == (rec.value or b"")
    reason = headers["dorylus.error"].decode()
    assert re.search(needle, reason), (name, reason)
    assert headers["dorylus.source.topic"] == rec.topic.encode() and headers["dorylus.source.offset"] == b"7"
    assert f"dead letter: {rec.topic}[1]@7" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ stream events
def _events(op, vertex=0, dst=None, features=None, label=None, split=None, event_id="e1"):
    return encode_events(events_batch([event_id], 1_000, [op], [vertex], dst=None if dst is None else [dst],
                                      features=None if features is None else [features],
                                      label=None if label is None else [label],
                                      split=None if split is None else [split]))


EVENT_CASES: dict[str, tuple[Callable[[], bytes], str]] = {
    "events-garbage": (lambda: b"\x01\x02not arrow", r"^schema: "),
    "events-engine-message": (lambda: codec.encode(TOPIC_MESSAGES["weights"], "run-a"), r"^schema: "),
    "events-unknown-op": (lambda: _events("merge_vertex"), r"unknown op 'merge_vertex'"),
    "events-negative-vertex": (lambda: _events("add_vertex", vertex=-4, features=[1.0] * 4),
                               r"negative vertex id -4"),
    "events-edge-without-dst": (lambda: _events("add_edge", vertex=1), r"edge event without dst"),
    "events-negative-dst": (lambda: _events("add_edge", vertex=1, dst=-2), r"negative vertex id -2"),
    "events-self-loop": (lambda: _events("add_edge", vertex=3, dst=3), r"self-loop 3-3"),
    "events-vertex-without-features": (lambda: _events("add_vertex", vertex=1), r"add_vertex without features"),
    "events-feature-width": (lambda: _events("update_features", vertex=1, features=[1.0] * 3),
                             r"feature row has 3 values, expected 4"),
    "events-nan-features": (lambda: _events("add_vertex", vertex=1, features=[1.0, float("nan"), 0.0, 0.0]),
                            r"features contain NaN or inf"),
    "events-label-without-label": (lambda: _events("set_label", vertex=1, split="train"),
                                   r"set_label without label"),
    "events-label-out-of-range": (lambda: _events("set_label", vertex=1, label=5, split="train"),
                                  r"label 5 out of range \[-1, 3\)"),
    "events-unknown-split": (lambda: _events("set_label", vertex=1, label=1, split="holdout"),
                             r"unknown split 'holdout'"),
    "events-unlabelled-in-split": (lambda: _events("set_label", vertex=1, label=-1, split="test"),
                                   r"unlabelled vertex"),
    "events-empty-id": (lambda: _events("add_edge", vertex=1, dst=2, event_id=""), r"empty event_id"),
}


@pytest.mark.parametrize("name", list(EVENT_CASES))
def test_stream_event_is_a_dead_letter(name, tmp_path):
    import re

    value, needle = EVENT_CASES[name]
    opts = StreamOptions(bootstrap="127.0.0.1:9", events_topic="ev", out=str(tmp_path / "s"), feature_dim=4,
                         num_classes=3)
    stream = Stream(opts, TrainConfig().resolved())
    stream._producer = _Recorder()
    stream.take_record(0, 11, value())
    assert stream.pending == [] and stream.counters["dead_letters"] == 1  # nothing reaches the graph
    [(topic, _, headers)] = stream._producer.sent
    assert topic == "ev.dlq" and headers["dorylus.source"] == b"ev/0/11"
    assert re.search(needle, headers["dorylus.reason"].decode()), (name, headers)
    assert stream.positions[0] == 12 and not (tmp_path / "s").exists()


# ------------------------------------------------------------------------------------------------ Lambda events
_SPEC = {"name": "gcn", "in_dim": 4, "hidden": [3], "num_classes": 2, "dropout": 0.5, "order": "av-first"}


@pytest.fixture(scope="module")
def lambda_task():
    import jax

    params = models.from_spec(_SPEC).init(jax.random.PRNGKey(0))
    flat = {f"{s}/{n}": np.asarray(v) for s, p in params.items() for n, v in p.items()}
    arrays = {"h": np.ones((6, 4), np.float32), "row_gids": np.arange(6, dtype=np.int32)}
    meta = {"model": _SPEC, "seed": 3, "attempt": 0}
    return arrays, meta, flat


def _lambda_event(lambda_task, arrays=None, meta=None, flat=None, stage=0, version=1, **top):
    a, m, w = lambda_task
    task = lambda_events.encode_task("AV", 1, stage, 0, 0, version, {**a, **(arrays or {})}, {**m, **(meta or {})})
    event = lambda_events.make_event(lambda_events.inline(task), lambda_events.inline(lambda_events.encode_weights(version, w if flat is None else flat)),
                          kind="AV")
    return {**event, **top}


LAMBDA_CASES: dict[str, tuple[Callable, str, str]] = {
    "lambda-no-event": (lambda t: None, "InvalidEvent", "JSON object"),
    "lambda-not-json": (lambda t: "{half", "InvalidEvent", "not JSON"),
    "lambda-no-version": (lambda t: {}, "InvalidEvent", "event_version"),
    "lambda-future-version": (lambda t: _lambda_event(t, event_version=42), "UnsupportedVersion", "42"),
    "lambda-unknown-field": (lambda t: _lambda_event(t, surprise=1), "InvalidEvent", "surprise"),
    "lambda-bad-base64": (lambda t: _lambda_event(t, input={"inline": "@@@"}), "InvalidEvent", "base64"),
    "lambda-two-sources": (lambda t: _lambda_event(t, input={"inline": "a", "s3": {}}), "InvalidEvent",
                           "exactly one"),
    "lambda-input-not-arrow": (lambda t: _lambda_event(t, input=lambda_events.inline(b"not arrow")), "InvalidInput", "Arrow"),
    "lambda-task-kind-mismatch": (lambda t: _lambda_event(t, task="AE"), "InvalidTask", "names task 'AE'"),
    "lambda-h-wrong-width": (lambda t: _lambda_event(t, arrays={"h": np.ones((6, 5), np.float32)}), "InvalidTask",
                             "takes"),
    "lambda-h-float64": (lambda t: _lambda_event(t, arrays={"h": np.ones((6, 4))}), "InvalidTask", "float32"),
    "lambda-stage-missing": (lambda t: _lambda_event(t, stage=9), "InvalidTask", "does not exist"),
    "lambda-unknown-model": (lambda t: _lambda_event(t, meta={"model": {"name": "mlp"}}), "InvalidTask",
                             "model spec"),
    "lambda-weights-lack-param": (lambda t: _lambda_event(t, flat={k: v for k, v in t[2].items()
                                                                   if not k.endswith("/w")}),
                                  "InvalidWeights", "lack"),
    "lambda-output-compression": (lambda t: _lambda_event(t, output={"compression": "rar"}), "InvalidEvent",
                                  "compression"),
}


def test_a_good_lambda_event_runs(lambda_task):
    assert LH.handler(_lambda_event(lambda_task), None)["ok"]


@pytest.mark.parametrize("name", list(LAMBDA_CASES))
def test_lambda_event_is_a_structured_error(name, lambda_task):
    build, typ, text = LAMBDA_CASES[name]
    resp = LH.handler(build(lambda_task), None)
    assert resp["ok"] is False and "result" not in resp, (name, resp)
    err = resp["error"]
    assert err["type"] == typ and text in err["message"] and "\n" not in err["message"], (name, err)
    assert err["retryable"] is False


# ------------------------------------------------------------------------------------------------ the count
def test_catalogue_size(record_property):
    counts = {"commands": len(CMD_CASES), "prepared directories": 2 * len(PREPARED_CASES),
              "kafka values": len(KAFKA_CASES), "stream events": len(EVENT_CASES),
              "lambda events": len(LAMBDA_CASES)}
    total = sum(counts.values())
    record_property(SUMMARY_LINE, f"bad-input catalogue: {total} cases "
                                  f"({', '.join(f'{v} {k}' for k, v in counts.items())})")
    assert total >= 60
