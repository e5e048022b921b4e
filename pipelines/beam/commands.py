"""`dorylus prepare ...` and `dorylus infer ...`: the Beam pipelines as subcommands of the project CLI.

Every argument after `prepare` (`infer`) goes to pipelines.beam.prepare.run (pipelines.beam.infer.run): its own flags,
then Beam's PipelineOptions; `dorylus prepare --help` (`dorylus infer --help`) prints them.
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


def cmd_infer(args) -> int:
    from pipelines.beam.infer import build_parser, run, summary_line
    from pipelines.beam.runners import RunnerUnavailable
    from pipelines.config import ConfigError

    argv = list(args.infer_args)
    try:
        record = run(argv)
    except RunnerUnavailable as e:
        raise ConfigError(str(e)) from None
    print(json.dumps(summary_line(record, build_parser().parse_known_args(argv)[0].out)))
    return 0


def register(sub) -> None:
    # prefix_chars="+": every "--flag" after `prepare` is a plain argument here, passed through unparsed
    p = sub.add_parser("prepare", add_help=False, prefix_chars="+",
                       help="validate, normalize, partition and shard a graph with Apache Beam "
                            "(`dorylus prepare --help`)")
    p.add_argument("prepare_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_prepare)
    p = sub.add_parser("infer", add_help=False, prefix_chars="+",
                       help="full-graph inference with a trained run's weights (Apache Beam): predictions and "
                            "embeddings as Parquet (`dorylus infer --help`)")
    p.add_argument("infer_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_infer)
