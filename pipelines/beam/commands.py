"""`dorylus prepare ...`: the Beam prepare pipeline as a subcommand of the project CLI (pipelines/cli.py).

Every argument after `prepare` goes to pipelines.beam.prepare (its own flags, then Beam's PipelineOptions);
`dorylus prepare --help` prints them.
"""
from __future__ import annotations

import argparse
import json


def cmd_prepare(args) -> int:
    from pipelines.beam.prepare import run, summary_line
    from pipelines.beam.runners import RunnerUnavailable
    from pipelines.config import ConfigError

    try:
        manifest = run(list(args.prepare_args))
    except RunnerUnavailable as e:   # the CLI prints ConfigError as one line, exit 2
        raise ConfigError(str(e)) from None
    print(json.dumps(summary_line(manifest)))
    return 0


def register(sub) -> None:
    # prefix_chars="+": every "--flag" after `prepare` is a plain argument here, passed through unparsed
    p = sub.add_parser("prepare", add_help=False, prefix_chars="+",
                       help="validate, normalize, partition and shard a graph with Apache Beam "
                            "(`dorylus prepare --help`)")
    p.add_argument("prepare_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_prepare)
