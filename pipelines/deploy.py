"""`dorylus deploy render`: what every instance of an AWS deployment runs, derived from the engine's config.

A deployed cluster must run exactly the processes `dorylus train --transport kafka --spawn-local` launches on one
machine, or the two drift apart. So nothing here writes a command line by hand: the role command lines come from
`pipelines.launch.role_commands` (the function the local launcher uses), called with the instance's paths and
shell placeholders, and are then turned into one template per role kind:

    role kind       where it runs (infra/terraform)                  template parameters
    graph-server    every graph-server instance, one per partition   $PARTITION (0..P-1)
    tensor-worker   beside it on every graph-server instance         $PARTITION (its worker id)
    param-server    the parameter-server instance                    -
    driver          beside it on the parameter-server instance       $NUM_PARTITIONS (tensor-worker processes)

and every template has $DORYLUS_BOOTSTRAP (the Kafka bootstrap brokers, unless --bootstrap gives a literal) and
$DORYLUS_RUN_ID (the run id naming the topics). The instances expand them at run time from /etc/dorylus/env, which
Terraform writes. The driver is `dorylus train --transport kafka` without --spawn-local: it evaluates, writes the
run directory and stops the roles, as it does locally.

Outputs (`--format`, or all of them with `--out DIR`):

- ``tfvars`` (``dorylus.tfvars``): the command lines and the values of the Terraform variables that the config
  decides (partition count, staleness, instance types, Lambda memory and concurrency, run id, name). Pass it last:
  ``terraform apply -var-file=my.tfvars -var-file=deploy/dorylus.tfvars``.
- ``json`` (``deploy.json``): the same, plus every role's argv and the deployment's changes to the config.
- ``sh`` (``roles.sh``): ``sh roles.sh ROLE`` runs one role kind, for machines that Terraform did not create.
- ``config.toml`` (with ``--out``): the config the instances read (/etc/dorylus/config.toml, uploaded to the
  deployment bucket's ``config_s3_key``): the engine's resolved config, with the deployment's changes (listed in
  deploy.json's ``overrides``): data_dir is the instance's dataset directory (Terraform syncs ``dataset_uri``
  there), transport is kafka, and the Lambda function defaults to the deployment's (``<name>-tensor-worker``).

``--estimate`` prints what the deployment costs per hour (and per epoch with ``--epoch-s``), priced by the
engine's cost model (`pipelines.engine.cost`, `pipelines/prices.toml`), instead of the rendering.

Config problems are one line on stderr and exit code 2 (`ConfigError`), like every `dorylus` command.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import shlex
import sys
from pathlib import Path, PurePosixPath

from pipelines.config import ConfigError, TrainConfig, build_config, load_toml

ENTRY = ["dorylus"]
INSTANCE_CONFIG = "/etc/dorylus/config.toml"
INSTANCE_STATE = "/var/lib/dorylus"
INSTANCE_DATA_DIR = f"{INSTANCE_STATE}/datasets"
INSTANCE_RUNS = f"{INSTANCE_STATE}/runs"

BOOTSTRAP_VAR = "$DORYLUS_BOOTSTRAP"
RUN_ID_VAR = "$DORYLUS_RUN_ID"
PARTITION_VAR = "$PARTITION"
NUM_PARTITIONS_VAR = "$NUM_PARTITIONS"
#: Shell variables the rendered command lines may contain; /etc/dorylus/env defines them on every instance.
PLACEHOLDERS = ("DORYLUS_BOOTSTRAP", "DORYLUS_RUN_ID", "PARTITION", "NUM_PARTITIONS")
_PLACEHOLDER_RE = re.compile(r"\$(" + "|".join(PLACEHOLDERS) + r")(?![A-Za-z0-9_])")

#: Role kinds and the Terraform variable that carries each one's command line.
ROLE_VARIABLES = {"graph-server": "graph_server_command", "tensor-worker": "tensor_worker_command",
                  "param-server": "param_server_command", "driver": "driver_command"}

# The Terraform side's limits (infra/terraform/variables.tf), checked here so that errors name the config setting.
TF_MAX_GRAPH_SERVERS = 256
TF_MAX_STALENESS = 64
TF_MAX_LAMBDAS_PER_SERVER = 1000
DEFAULT_LAMBDAS_PER_SERVER = 80          # Dorylus's Reddit run; variables.tf's default
RESERVED_HEADROOM = 1.25                 # reserved concurrency = servers x Lambdas x 1.25 (straggler relaunches)
DEFAULT_NAME = "dorylus"                 # variables.tf's default deployment name
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
NAME_RE = re.compile(r"^[a-z][a-z0-9-]{1,22}[a-z0-9]$")
BOOTSTRAP_RE = re.compile(r"^[A-Za-z0-9.-]+:[0-9]+(,[A-Za-z0-9.-]+:[0-9]+)*$")
INSTANCE_TYPE_RE = re.compile(r"^[a-z][a-z0-9-]*\.[a-z0-9]+$")


@dataclasses.dataclass
class Rendering:
    """What `render` produces: the instance config, the role templates (argv with placeholders) and tfvars."""

    config: TrainConfig             # the config the instances read
    source: TrainConfig             # the config of the file, as the engine reads it
    config_path: str                # the file it came from
    run_id: str
    bootstrap: str
    name: str
    templates: dict[str, list[str]]   # role kind -> argv with placeholders
    tfvars: dict
    overrides: dict                 # setting -> [local value, instance value]
    notes: list[str]

    @property
    def commands(self) -> dict[str, str]:
        """Role kind -> the command line (/bin/sh syntax) the instance runs."""
        return {kind: shell_join(argv) for kind, argv in self.templates.items()}

    def config_toml(self) -> str:
        return self.config.to_toml()

    def to_json(self) -> dict:
        P = self.config.partitions
        where = {"graph-server": f"each graph-server instance, PARTITION = 0..{P - 1}",
                 "tensor-worker": f"beside the graph server on each graph-server instance, PARTITION = 0..{P - 1}",
                 "param-server": "the parameter-server instance",
                 "driver": "beside the parameter server on the parameter-server instance"}
        return {
            "config": self.config_path,
            "run_id": self.run_id,
            "bootstrap": self.bootstrap,
            "partitions": P,
            "instance_config": INSTANCE_CONFIG,
            "placeholders": {f"${v}": _PLACEHOLDER_DOC[v] for v in PLACEHOLDERS},
            "roles": {kind: {"argv": argv, "command": shell_join(argv), "runs_on": where[kind],
                             "terraform_variable": ROLE_VARIABLES[kind]}
                      for kind, argv in self.templates.items()},
            "tfvars": self.tfvars,
            "overrides": self.overrides,
            "notes": self.notes,
            "config_toml": self.config_toml(),
        }


_PLACEHOLDER_DOC = {
    "DORYLUS_BOOTSTRAP": "Kafka bootstrap brokers (Terraform: the MSK cluster's, or existing_kafka_bootstrap)",
    "DORYLUS_RUN_ID": "the run id naming the Kafka topics (Terraform variable run_id)",
    "PARTITION": "this graph server's partition, 0..NUM_PARTITIONS-1 (also its tensor worker's id)",
    "NUM_PARTITIONS": "graph_server_count (the tensor-worker processes the driver waits for)",
}


# ------------------------------------------------------------------------------------------------ shell syntax
def shell_word(arg: str) -> str:
    """One argv element as a /bin/sh word: placeholders expand at run time (in double quotes), nothing else does."""
    if not _PLACEHOLDER_RE.search(arg):
        return shlex.quote(arg)
    out, pos = ['"'], 0
    for m in _PLACEHOLDER_RE.finditer(arg):
        out.append(_dq_escape(arg[pos:m.start()]))
        out.append(m.group(0))
        pos = m.end()
    out.append(_dq_escape(arg[pos:]))
    out.append('"')
    return "".join(out)


def _dq_escape(s: str) -> str:
    return re.sub(r'([\\"$`])', r"\\\1", s)


def shell_join(argv: list[str]) -> str:
    return " ".join(shell_word(a) for a in argv)


def expand(argv: list[str], env: dict[str, str]) -> list[str]:
    """An argv template with its placeholders replaced (what /bin/sh does with `shell_join`'s words)."""
    return [_PLACEHOLDER_RE.sub(lambda m: env[m.group(1)], a) for a in argv]


# ------------------------------------------------------------------------------------------------ rendering
def load_config(path: str | Path) -> TrainConfig:
    """The engine's config of a file, validated as `dorylus train --config FILE` validates it."""
    return build_config(load_toml(path), {})


def default_run_id(cfg: TrainConfig) -> str:
    """A run id that changes when the config does (fresh topics) and not otherwise (re-rendering is idempotent)."""
    base = re.sub(r"[^A-Za-z0-9_-]+", "-", PurePosixPath(cfg.dataset or "planted").stem).strip("-_")[:32] or "run"
    digest = hashlib.sha256(cfg.to_toml().encode()).hexdigest()[:8]
    return f"{base}-{cfg.model}-{digest}"


def check_deployable(cfg: TrainConfig) -> None:
    """What the engine accepts but a deployment cannot run; one line each, naming the setting."""
    if cfg.prepared:
        raise ConfigError("prepared: the Kafka roles load --dataset (a prepared directory is not supported on "
                          "--transport kafka yet); give dataset instead")
    if cfg.partitions > TF_MAX_GRAPH_SERVERS:
        raise ConfigError(f"partitions ({cfg.partitions}) exceeds the deployment's {TF_MAX_GRAPH_SERVERS} graph "
                          f"servers (graph_server_count)")
    if cfg.staleness is not None and cfg.staleness > TF_MAX_STALENESS:
        raise ConfigError(f"staleness ({cfg.staleness}) exceeds the deployment's limit of {TF_MAX_STALENESS}")
    if cfg.dataset and cfg.dataset.startswith("/") and not cfg.dataset.startswith(INSTANCE_STATE + "/"):
        raise ConfigError(f"dataset {cfg.dataset!r} is a path on this machine; on the instances the dataset_uri is "
                          f"synced to {INSTANCE_DATA_DIR}: give datasets/<file> (relative to {INSTANCE_STATE}) or "
                          f"a known dataset name")
    for key in ("graph_instance", "ps_instance"):
        v = getattr(cfg, key)
        if not INSTANCE_TYPE_RE.match(v):
            raise ConfigError(f"{key}: {v!r} is not an EC2 instance type (like c5.2xlarge)")
    if cfg.lambda_concurrency is not None and cfg.lambda_concurrency > TF_MAX_LAMBDAS_PER_SERVER:
        raise ConfigError(f"lambda_concurrency ({cfg.lambda_concurrency}) exceeds the deployment's "
                          f"{TF_MAX_LAMBDAS_PER_SERVER} Lambdas per graph server")


def lambdas_per_server(cfg: TrainConfig) -> int:
    """Concurrent Lambdas one tensor-worker process (one per graph server) may keep in flight."""
    if cfg.lambda_concurrency is not None:
        return int(cfg.lambda_concurrency)
    if cfg.tensor_workers == "aws":   # autotuned: up to the pool's maximum
        from pipelines.engine.pools import MAX_WORKERS

        return MAX_WORKERS
    return DEFAULT_LAMBDAS_PER_SERVER


def role_templates(bootstrap: str, run_id: str, partitions: int) -> dict[str, list[str]]:
    """One argv template per role kind, from `role_commands` (the local launcher's) and the driver's command line.

    role_commands is called for every partition with the instance's paths; a kind's lines may differ only in the
    partition (graph servers) or the worker id (tensor workers), which become $PARTITION."""
    from pipelines.launch import role_commands

    out = f"{INSTANCE_RUNS}/{run_id}"
    cmds = role_commands(INSTANCE_CONFIG, bootstrap, run_id, out=out, partitions=partitions, workers=partitions,
                         entry=ENTRY)
    templates = {"graph-server": _parametrize(cmds, "graph-server", "--partition", partitions),
                 "tensor-worker": _parametrize(cmds, "tensor-worker", "--worker-id", partitions),
                 "param-server": cmds.pop("param-server")}
    tw = templates["tensor-worker"]  # one tensor worker per graph-server instance: W is the instance count
    tw[tw.index("--workers") + 1] = NUM_PARTITIONS_VAR
    if cmds:
        raise ConfigError(f"role_commands returned roles that no instance runs: {', '.join(sorted(cmds))}")
    templates["driver"] = ENTRY + ["train", "--config", INSTANCE_CONFIG, "--transport", "kafka",
                                   "--bootstrap", bootstrap, "--run-id", run_id,
                                   "--worker-processes", NUM_PARTITIONS_VAR, "--out", out, "--overwrite", "--quiet"]
    return templates


def _parametrize(cmds: dict[str, list[str]], kind: str, flag: str, n: int) -> list[str]:
    template = None
    for p in range(n):
        argv = list(cmds.pop(f"{kind}-{p}"))
        i = argv.index(flag)
        if argv[i + 1] != str(p):
            raise ConfigError(f"role_commands: {kind}-{p} has {flag} {argv[i + 1]}, not {p}")
        argv[i + 1] = PARTITION_VAR
        if template is not None and argv != template:
            raise ConfigError(f"role_commands: the {kind} command lines differ in more than {flag}")
        template = argv
    return template


def render(config_path: str | Path, *, bootstrap: str | None = None, run_id: str | None = None,
           name: str = DEFAULT_NAME, overrides: dict | None = None) -> Rendering:
    """Validate the config and render the deployment (see the module doc); `overrides` (a `dorylus plan` row's
    settings) replace the config file's."""
    if not NAME_RE.match(name):
        raise ConfigError(f"--name {name!r}: 3-24 lower-case letters, digits and hyphens, starting with a letter "
                          f"(Terraform's name)")
    values = {**load_toml(config_path), **(overrides or {})}
    function_default = None
    if values.get("tensor_workers") == "aws" and not values.get("function"):
        # The deployment's function; the engine's validation (below) needs one.
        function_default = values["function"] = f"{name}-tensor-worker"
    cfg = build_config(values, {})
    check_deployable(cfg)
    bootstrap = bootstrap or BOOTSTRAP_VAR
    if bootstrap != BOOTSTRAP_VAR and not BOOTSTRAP_RE.match(bootstrap):
        raise ConfigError(f"--bootstrap {bootstrap!r}: give HOST:PORT[,HOST:PORT...] or leave it out "
                          f"(the instances' {BOOTSTRAP_VAR})")
    notes: list[str] = []
    inst = dataclasses.replace(cfg)
    overrides: dict = {}

    def override(key, value):
        before = getattr(inst, key)
        if before != value:
            overrides[key] = [before, value]
            setattr(inst, key, value)

    override("transport", "kafka")
    override("data_dir", INSTANCE_DATA_DIR)
    override("bootstrap", None)   # --bootstrap on every command line
    override("out", None)         # --out on every command line
    override("prices", None)      # a local file; only the cost estimate uses it
    if function_default:
        overrides["function"] = [None, function_default]
    if cfg.tensor_workers == "aws":
        if cfg.function != f"{name}-tensor-worker" and ":function:" not in cfg.function:
            notes.append(f"function {cfg.function!r} is not this deployment's ({name}-tensor-worker)")
        if not cfg.bucket:
            notes.append("bucket is unset: task payloads over Lambda's 6 MB invoke limit will fail; set bucket to "
                         "the deployment bucket (terraform output bucket_name) and s3_prefix to its lambda_s3_prefix")
    elif cfg.mode == "serverless":
        notes.append(f"tensor_workers = {cfg.tensor_workers!r}: the tensor-worker processes run a local pool on the "
                     f"graph-server instances, not Lambdas")
    inst.validate()
    run_id = run_id or default_run_id(inst)
    if not RUN_ID_RE.match(run_id):
        raise ConfigError(f"--run-id {run_id!r}: 1-64 letters, digits, '-' and '_' (it names Kafka topics)")

    P = cfg.partitions
    lam = lambdas_per_server(cfg)
    templates = role_templates(bootstrap, RUN_ID_VAR, P)
    tfvars = {
        "name": name,
        "run_id": run_id,
        "graph_server_count": P,
        "param_server_count": 1,
        "graph_server_instance_type": cfg.graph_instance,
        "param_server_instance_type": cfg.ps_instance,
        "staleness": cfg.staleness,
        "lambda_memory_mb": cfg.lambda_memory_mb,
        "lambdas_per_graph_server": lam,
        "lambda_reserved_concurrency": max(1, math.ceil(P * lam * RESERVED_HEADROOM)),
        **{ROLE_VARIABLES[k]: shell_join(argv) for k, argv in templates.items()},
    }
    return Rendering(inst, cfg, str(config_path), run_id, bootstrap, name, templates, tfvars, overrides, notes)


# ------------------------------------------------------------------------------------------------ formats
def to_tfvars(r: Rendering) -> str:
    lines = [f"# Generated by `dorylus deploy render --config {r.config_path}`; do not edit: render again.",
             "# Pass it after your own tfvars: terraform apply -var-file=my.tfvars -var-file=dorylus.tfvars ...",
             f"# Upload the instance config too: aws s3 cp config.toml \"$(terraform output -raw config_uri)\"", ""]
    width = max(len(k) for k in r.tfvars)
    for k, v in r.tfvars.items():
        lines.append(f"{k.ljust(width)} = {_hcl(v)}")
    return "\n".join(lines) + "\n"


def _hcl(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    # An HCL string: JSON escapes, plus ${ and %{ escaped so Terraform does not interpolate them.
    return json.dumps(str(v)).replace("${", "$${").replace("%{", "%%{")


def to_sh(r: Rendering) -> str:
    P = r.config.partitions
    lines = [
        "#!/bin/sh",
        f"# Generated by `dorylus deploy render --config {r.config_path}`: the command line of every role kind.",
        "# Usage: sh roles.sh ROLE, with the config at " + INSTANCE_CONFIG + " and in the environment",
        "#   DORYLUS_BOOTSTRAP (Kafka), PARTITION (graph-server, tensor-worker: 0.."
        f"{P - 1}); DORYLUS_RUN_ID and NUM_PARTITIONS default to this rendering's.",
        "#   graph-server and tensor-worker: one each per partition; param-server and driver: one each.",
        "set -eu",
        f': "${{DORYLUS_RUN_ID:={r.run_id}}}"',
        f': "${{NUM_PARTITIONS:={P}}}"',
        'case "${1:-}" in',
    ]
    for kind, cmd in r.commands.items():
        lines.append(f"  {kind}) exec {cmd} ;;")
    lines += [f'  *) echo "usage: $0 {"|".join(r.templates)}" >&2; exit 2 ;;', "esac"]
    return "\n".join(lines) + "\n"


FORMATS = {"tfvars": ("dorylus.tfvars", to_tfvars),
           "json": ("deploy.json", lambda r: json.dumps(r.to_json(), indent=2) + "\n"),
           "sh": ("roles.sh", to_sh)}


# ------------------------------------------------------------------------------------------------ cost estimate
def estimate(cfg: TrainConfig, *, lambdas: int | None = None, epoch_s: float | None = None,
             lambda_busy: float = 1.0, task_s: float = 1.0, prices: dict | None = None) -> dict:
    """What the deployment costs, priced by the engine's cost model (`pipelines.engine.cost.price_usage`).

    Per hour: the graph servers and the parameter server for the hour, and every Lambda (partitions x lambdas)
    billed for `lambda_busy` of it (1.0: all of them busy all the time, the upper bound) at the configured
    memory, one request per `task_s` seconds of busy time. Per epoch (with `epoch_s`, a measured epoch time): the
    same for epoch_s seconds, and Dorylus's value 1 / (epoch time x cost). Not included: MSK brokers, VPC
    endpoints, KMS, CloudWatch, S3 storage and data transfer (fixed costs of the stack, not of training)."""
    from pipelines.engine.cost import check_instances, load_prices, price_usage, value

    prices = prices or load_prices(cfg.prices)
    check_instances(prices, cfg.graph_instance, cfg.ps_instance)
    if not 0.0 <= lambda_busy <= 1.0:
        raise ConfigError(f"--lambda-busy must be in [0, 1], got {lambda_busy}")
    if task_s <= 0:
        raise ConfigError(f"--task-s must be > 0, got {task_s}")
    if epoch_s is not None and epoch_s <= 0:
        raise ConfigError(f"--epoch-s must be > 0, got {epoch_s}")
    serverless = cfg.mode == "serverless" and cfg.tensor_workers == "aws"
    per_server = (lambdas if lambdas is not None else lambdas_per_server(cfg)) if serverless else 0
    n_lambdas = cfg.partitions * per_server

    def usage(seconds: float) -> dict:
        billed_ms = n_lambdas * seconds * 1000.0 * lambda_busy
        return {"time_s": seconds, "graph_servers": cfg.partitions, "graph_instance": cfg.graph_instance,
                "param_servers": 1, "ps_instance": cfg.ps_instance, "lambda_billed_ms": billed_ms,
                "lambda_memory_mb": cfg.lambda_memory_mb, "lambda_invocations": billed_ms / (task_s * 1000.0),
                "s3_puts": 0, "s3_gets": 0}

    out = {"prices": prices.get("source"), "graph_servers": f"{cfg.partitions} x {cfg.graph_instance}",
           "param_server": f"1 x {cfg.ps_instance}", "lambdas": n_lambdas,
           "lambdas_per_graph_server": per_server, "lambda_memory_mb": cfg.lambda_memory_mb,
           "lambda_busy": lambda_busy, "task_s": task_s, "per_hour_usd": price_usage(usage(3600.0), prices)}
    if epoch_s is not None:
        per_epoch = price_usage(usage(epoch_s), prices)
        out.update(epoch_s=epoch_s, per_epoch_usd=per_epoch, value_per_epoch=value(epoch_s, per_epoch["total"]))
        if cfg.epochs:
            out.update(epochs=cfg.epochs, run_usd=per_epoch["total"] * cfg.epochs)
    return out


def estimate_text(e: dict) -> str:
    from pipelines.engine.cost import VALUE_UNITS

    items = ("graph_servers", "param_server", "lambda_compute", "lambda_requests", "total")
    lines = [f"deployment: graph servers {e['graph_servers']}, parameter server {e['param_server']}, "
             f"{e['lambdas']} Lambdas ({e['lambdas_per_graph_server']} per graph server) at "
             f"{e['lambda_memory_mb']} MB, busy {e['lambda_busy']:.0%}, one request per {e['task_s']:g} s",
             f"prices: {e['prices']}", ""]
    head = f"{'':18}{'per hour':>12}"
    if "per_epoch_usd" in e:
        head += f"{'per epoch':>14}"
    lines.append(head)
    for k in items:
        row = f"{k:18}{e['per_hour_usd'][k]:>12.4f}"
        if "per_epoch_usd" in e:
            row += f"{e['per_epoch_usd'][k]:>14.6f}"
        lines.append(row)
    if "per_epoch_usd" in e:
        lines.append("")
        lines.append(f"epoch time {e['epoch_s']:g} s: value 1/(time x cost) = {e['value_per_epoch']:.4g} "
                     f"{VALUE_UNITS} per epoch; {e['epochs']} epochs = ${e['run_usd']:.4f}")
    lines.append("not included: MSK brokers, VPC endpoints, KMS, CloudWatch, S3 storage (the stack's fixed costs)")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ CLI
def cmd_render(args) -> int:
    overrides = None
    if args.plan or args.row:
        if not (args.plan and args.row):
            raise ConfigError("--plan and --row go together: a plan.json and the row to deploy")
        from pipelines.plan.commands import row_config

        overrides = row_config(args.plan, args.row)
    r = render(args.config, bootstrap=args.bootstrap, run_id=args.run_id, name=args.name, overrides=overrides)
    est = None
    if args.estimate:
        from pipelines.engine.cost import load_prices

        est = estimate(r.config, epoch_s=args.epoch_s, lambda_busy=args.lambda_busy, task_s=args.task_s,
                       prices=load_prices(args.prices or r.source.prices))
    for note in r.notes:
        print(f"dorylus: note: {note}", file=sys.stderr)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for fmt, (fname, fn) in FORMATS.items():
            (out / fname).write_text(fn(r))
            written.append(fname)
        (out / "roles.sh").chmod(0o755)
        (out / "config.toml").write_text(r.config_toml())
        written.append("config.toml")
        if est is not None:
            (out / "estimate.json").write_text(json.dumps(est, indent=2) + "\n")
            written.append("estimate.json")
        print(f"dorylus: run {r.run_id}, {r.config.partitions} graph servers: wrote {', '.join(written)} to {out}",
              file=sys.stderr)
    if est is not None:
        sys.stdout.write(json.dumps(est, indent=2) + "\n" if args.format == "json" else estimate_text(est))
    elif not args.out:
        sys.stdout.write(FORMATS[args.format][1](r))
    return 0


def register(subparsers) -> None:
    d = subparsers.add_parser("deploy", help="the AWS deployment (infra/terraform) of a config")
    dsub = d.add_subparsers(dest="deploy_command", required=True, parser_class=type(d))
    r = dsub.add_parser("render", help="render what every instance runs (command lines, tfvars, config) from the "
                                       "engine's config",
                        description="Render the role command lines (from the local launcher's role_commands), the "
                                    "Terraform variables and the instance config of a deployment.")
    r.add_argument("--config", required=True, help="the engine's config TOML (as for dorylus train --config)")
    r.add_argument("--bootstrap", help=f"Kafka bootstrap HOST:PORT[,...] (default: {BOOTSTRAP_VAR}, the brokers "
                                       "Terraform hands every instance)")
    r.add_argument("--run-id", help="the run id naming the Kafka topics (default: from the dataset, model and a hash "
                                    "of the config; give a new one to run the same config again)")
    r.add_argument("--name", default=DEFAULT_NAME, help="the deployment's Terraform name (default dorylus); names "
                                                        "the Lambda function")
    r.add_argument("--out", help="write dorylus.tfvars, deploy.json, roles.sh and config.toml to this directory")
    r.add_argument("--format", choices=sorted(FORMATS), default="tfvars", help="what to print (default tfvars)")
    r.add_argument("--plan", help="a plan.json of `dorylus plan`: deploy one of its rows (with --row)")
    r.add_argument("--row", help="the plan row to deploy: its number, best-value or fastest")
    g = r.add_argument_group("cost estimate (the engine's cost model and price table)")
    g.add_argument("--estimate", action="store_true", help="print the deployment's cost per hour (and per epoch) "
                                                           "instead of the rendering")
    g.add_argument("--epoch-s", type=float, help="a measured epoch time in seconds: adds cost and value per epoch")
    g.add_argument("--lambda-busy", type=float, default=1.0,
                   help="fraction of the time the Lambdas are busy (billed); default 1.0, the upper bound")
    g.add_argument("--task-s", type=float, default=1.0, help="mean tensor-task time, for the request count")
    g.add_argument("--prices", help="price table overriding pipelines/prices.toml (default: the config's prices)")
    r.set_defaults(func=cmd_render)


__all__ = ["Rendering", "render", "role_templates", "shell_join", "shell_word", "expand", "estimate", "to_tfvars",
           "to_sh", "check_deployable", "INSTANCE_CONFIG", "ENTRY", "PLACEHOLDERS", "ROLE_VARIABLES"]
