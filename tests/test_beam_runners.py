"""Runner flags (pipelines/beam/runners.py) and, with the job-server jar, a trivial pipeline on the FlinkRunner."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("apache_beam")

from apache_beam.options.pipeline_options import (  # noqa: E402
    DirectOptions, FlinkRunnerOptions, PipelineOptions, PortableOptions, StandardOptions)

from pipelines.beam import runners  # noqa: E402
from pipelines.beam.runners import RunnerUnavailable, runner_options  # noqa: E402


def test_direct_flags():
    assert runner_options("direct", []) == ["--runner=DirectRunner"]
    flags = runner_options("DirectRunner", ["--foo=1"], num_workers=3)
    opts = PipelineOptions(flags)
    assert opts.view_as(StandardOptions).runner == "DirectRunner"
    assert opts.view_as(DirectOptions).direct_running_mode == "multi_processing"
    assert opts.view_as(DirectOptions).direct_num_workers == 3
    assert flags[-1] == "--foo=1"
    with pytest.raises(ValueError, match="unknown runner"):
        runner_options("spark", [])


def test_flink_flags_from_env(tmp_path, monkeypatch):
    jar = tmp_path / "beam-runners-flink-1.20-job-server-2.77.0.jar"
    jar.write_bytes(b"PK")
    monkeypatch.setenv("DORYLUS_FLINK_JOB_SERVER_JAR", str(jar))
    monkeypatch.delenv("DORYLUS_FLINK_VERSION", raising=False)
    flags = runner_options("flink", ["--flink_master=[auto]"], parallelism=2)
    opts = PipelineOptions(flags)
    f = opts.view_as(FlinkRunnerOptions)
    assert opts.view_as(StandardOptions).runner == "FlinkRunner"
    assert f.flink_job_server_jar == str(jar) and f.flink_version == "1.20" and f.parallelism == 2
    assert f.flink_master == "[auto]"   # extra_argv wins
    assert opts.view_as(PortableOptions).environment_type == "LOOPBACK"


def test_flink_flags_from_cache_pointer(tmp_path, monkeypatch):
    monkeypatch.delenv("DORYLUS_FLINK_JOB_SERVER_JAR", raising=False)
    monkeypatch.setenv("DORYLUS_CACHE", str(tmp_path))
    with pytest.raises(RunnerUnavailable, match="infra/local/flink.sh fetch"):
        runner_options("flink", [])
    assert not runners.flink_available()
    jar = tmp_path / "beam" / "x.jar"
    jar.parent.mkdir()
    jar.write_bytes(b"PK")
    (tmp_path / "beam" / "flink-job-server.json").write_text(
        json.dumps({"jar": str(jar), "kind": "assembled", "flink_version": "1.19", "beam_version": "2.62.0"}))
    flags = runner_options("flink", [])
    assert f"--flink_job_server_jar={jar}" in flags and "--flink_version=1.19" in flags
    assert "--flink_master=[local]" in flags and "--environment_type=LOOPBACK" in flags
    monkeypatch.setenv("DORYLUS_FLINK_JOB_SERVER_JAR", str(tmp_path / "missing.jar"))
    with pytest.raises(RunnerUnavailable, match="is not a file"):
        runner_options("flink", [])


@pytest.mark.flink
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # LOOPBACK data-plane hang-up
def test_trivial_pipeline_on_flink(flink_flags):
    import apache_beam as beam
    from apache_beam.testing.util import assert_that, equal_to

    with beam.Pipeline(options=PipelineOptions(flink_flags)) as p:
        out = p | beam.Create(range(10)) | beam.Map(lambda x: (x % 3, x)) | beam.CombinePerKey(sum)
        assert_that(out, equal_to([(0, 18), (1, 12), (2, 15)]))
