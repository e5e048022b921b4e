"""Beam runner flags for the runners this project uses: the DirectRunner and the FlinkRunner (embedded cluster).

    from pipelines.beam.runners import runner_options
    options = PipelineOptions(runner_options("flink", ["--parallelism=2"]))

``runner_options(runner, extra_argv)`` returns the runner's flags followed by ``extra_argv`` (argparse keeps the
last value of a flag, so anything in ``extra_argv`` overrides a default here). The pipelines' ``--engine`` and
``--workers`` shorthands are :func:`add_engine_arguments` and :func:`engine_flags`.

Flink runs as Beam's portable FlinkRunner: Python starts the Beam Flink job server (a Java process) with
``--flink_master=[local]``, which runs an embedded Flink mini cluster; ``--environment_type=LOOPBACK`` runs the
Python SDK harness inside this process. The job-server jar is found, in order, at
``$DORYLUS_FLINK_JOB_SERVER_JAR`` or where ``infra/local/flink.sh fetch`` recorded it
(``<cache>/flink-job-server.json``, cache = ``$DORYLUS_CACHE/beam`` or ``<repo>/.cache/beam``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
import argparse
from typing import Sequence

from pipelines.data.graph import DataError

REPO = Path(__file__).resolve().parents[2]
FETCH_HINT = "infra/local/flink.sh fetch"
JAR_ENV = "DORYLUS_FLINK_JOB_SERVER_JAR"
DEFAULT_FLINK_VERSION = "1.19"
RUNNERS = ("direct", "flink")


class RunnerUnavailable(RuntimeError):
    """A runner cannot be used here (e.g. the Flink job-server jar has not been fetched)."""


def cache_dir() -> Path:
    base = os.environ.get("DORYLUS_CACHE")
    return Path(base) / "beam" if base else REPO / ".cache" / "beam"


def flink_job_server() -> dict:
    """{'jar': path, 'flink_version': 'X.Y', 'kind': 'env'|'official'|'assembled', ...}; RunnerUnavailable if none."""
    env = os.environ.get(JAR_ENV)
    if env:
        if not os.path.isfile(env):
            raise RunnerUnavailable(f"${JAR_ENV}={env} is not a file; unset it or run {FETCH_HINT}")
        return {"jar": env, "kind": "env",
                "flink_version": os.environ.get("DORYLUS_FLINK_VERSION", _flink_version_of(env))}
    pointer = cache_dir() / "flink-job-server.json"
    if pointer.is_file():
        info = json.loads(pointer.read_text())
        jar = info.get("jar", "")
        if os.path.isfile(jar):
            return info
    raise RunnerUnavailable(
        f"no Beam Flink job-server jar: set ${JAR_ENV} or run `{FETCH_HINT}` "
        f"(looked for {pointer})")


def flink_available() -> bool:
    try:
        flink_job_server()
        return True
    except RunnerUnavailable:
        return False


def _flink_version_of(jar: str) -> str:
    # beam-runners-flink-1.19-job-server-2.62.0.jar -> 1.19
    name = os.path.basename(jar)
    marker = "beam-runners-flink-"
    if name.startswith(marker):
        ver = name[len(marker):].split("-", 1)[0]
        if ver.replace(".", "").isdigit():
            return ver
    return DEFAULT_FLINK_VERSION


_shared = {}   # jar -> (job server, endpoint): one Flink job server per process when shared_job_server=True


def shared_flink_job_endpoint(flags: Sequence[str]) -> str:
    """Start (once per process, stopped at exit) the Flink job server that ``flags`` describe; its endpoint.

    Each FlinkRunner pipeline otherwise starts its own job-server JVM (several seconds) and keeps it running
    until this process exits."""
    import atexit

    from apache_beam.options.pipeline_options import FlinkRunnerOptions, PipelineOptions
    from apache_beam.runners.portability.flink_runner import FlinkJarJobServer

    class _Server(FlinkJarJobServer):
        endpoint = None

        def subprocess_cmd_and_endpoint(self):
            cmd, endpoint = super().subprocess_cmd_and_endpoint()
            self.endpoint = endpoint
            return cmd, endpoint

    options = PipelineOptions(list(flags))
    jar = options.view_as(FlinkRunnerOptions).flink_job_server_jar
    if jar not in _shared:
        server = _Server(options)
        server.start()   # returns once the job service answers
        atexit.register(server.stop)
        _shared[jar] = (server, server.endpoint)
    return _shared[jar][1]


class CommandParser(argparse.ArgumentParser):
    """argparse for the Beam commands: a wrong flag is a one-line DataError (exit 2), not usage text."""

    def error(self, message):
        raise DataError(f"{self.prog}: {message}")


def pipeline_options(pipeline_args: Sequence[str]):
    """PipelineOptions of the flags a command left to Beam; a flag Beam does not know either is a DataError
    (Beam itself would drop it with a log line and run anyway, so a mistyped flag would go unnoticed)."""
    from apache_beam.options.pipeline_options import PipelineOptions  # Beam loads only for a pipeline run

    options = PipelineOptions(list(pipeline_args))
    unknown = set(options.get_all_options(retain_unknown_options=True)) - set(PipelineOptions([]).get_all_options())
    if unknown:
        flags = ", ".join(f"--{k}" for k in sorted(unknown))
        raise DataError(f"unrecognized arguments: {flags} (neither this command's flags nor Beam pipeline "
                          f"options; --help lists them)")
    return options


def runner_options(runner: str, extra_argv: Sequence[str] = (), *, num_workers: int | None = None,
                   parallelism: int | None = None, quiet_job_server: bool = True,
                   shared_job_server: bool = False) -> list[str]:
    """Beam pipeline flags for ``runner`` ('direct' or 'flink'), then ``extra_argv``.

    direct: ``--runner=DirectRunner``; with ``num_workers`` > 1 also
        ``--direct_running_mode=multi_processing --direct_num_workers=N``.
    flink: ``--runner=FlinkRunner --flink_master=[local] --environment_type=LOOPBACK
        --flink_job_server_jar=JAR --flink_version=X.Y`` (+ ``--parallelism=N`` when given; Flink's
        local default is otherwise used). Raises RunnerUnavailable when no jar is found.
        ``shared_job_server=True`` starts the job server now, once per process, and adds
        ``--job_endpoint=localhost:PORT`` so that every pipeline of this process reuses it.
    """
    runner = runner.lower().removesuffix("runner")
    extra = list(extra_argv or ())
    if runner == "direct":
        flags = ["--runner=DirectRunner"]
        if num_workers is not None and num_workers > 1:
            flags += ["--direct_running_mode=multi_processing", f"--direct_num_workers={int(num_workers)}"]
        return flags + extra
    if runner == "flink":
        info = flink_job_server()
        flags = [
            "--runner=FlinkRunner",
            "--flink_master=[local]",
            "--environment_type=LOOPBACK",
            f"--flink_job_server_jar={info['jar']}",
            f"--flink_version={info.get('flink_version') or DEFAULT_FLINK_VERSION}",
        ]
        if parallelism is not None:
            flags.append(f"--parallelism={int(parallelism)}")
        if quiet_job_server:
            # slf4j-simple (assembled job server) logs every Flink INFO line otherwise
            flags.append("--job_server_jvm_property=-Dorg.slf4j.simpleLogger.defaultLogLevel=warn")
        if shared_job_server:
            flags.append(f"--job_endpoint={shared_flink_job_endpoint(flags)}")
        return flags + extra
    raise ValueError(f"unknown runner {runner!r}; expected one of {', '.join(RUNNERS)}")


def add_engine_arguments(ap) -> None:
    """The ``--engine``/``--workers`` shorthand flags of the project's pipelines (see :func:`engine_flags`)."""
    ap.add_argument("--engine", choices=RUNNERS,
                    help="shorthand for the runner flags of pipelines.beam.runners.runner_options")
    ap.add_argument("--workers", type=int, metavar="N",
                    help="with --engine direct: N worker processes (multi-processing mode); with --engine flink: "
                         "the parallelism")


def engine_flags(engine: str | None, workers: int | None, pipeline_args: Sequence[str]) -> list[str]:
    """--engine/--workers -> Beam flags (:func:`runner_options`), then the caller's Beam flags."""
    if not engine:
        if workers:
            engine = "direct"
        else:
            return list(pipeline_args)
    if engine == "direct":
        return runner_options("direct", pipeline_args, num_workers=workers)
    return runner_options(engine, pipeline_args, parallelism=workers)
