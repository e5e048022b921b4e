"""`dorylus deploy render`: the deployed cluster runs what the local launcher runs, and Terraform accepts it.

- every role's command line, as rendered (tfvars and roles.sh), run through /bin/sh the way the instances run it
  (with a stand-in `dorylus` that prints its argv), equals `pipelines.launch.role_commands` for the same run;
- every rendered argv parses with the real `dorylus` parser (the flags exist);
- the tfvars parse with python-hcl2, set only declared variables, and pass the variables' validation blocks:
  in Python, and with a real `terraform plan` over infra/terraform/variables.tf when a terraform binary exists
  (no provider needed);
- Terraform's default command lines are the rendering; the Reddit example config renders the Reddit tfvars;
- config errors are one line and exit code 2; the cost estimate is the cost model's.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import hcl2
import pytest

from pipelines import deploy
from pipelines.cli import build_parser, main
from pipelines.launch import role_commands

REPO = Path(__file__).resolve().parents[1]
TF_ROOT = REPO / "infra" / "terraform"
BOOT = "b-1.kafka.internal:9098,b-2.kafka.internal:9098"
RUN = "reddit-gcn-run7"
P = 3

CONFIG = f"""
dataset = "datasets/graph.npz"
model = "gcn"
epochs = 30
partitions = {P}
intervals = 4
staleness = 1
tensor_workers = "aws"
lambda_concurrency = 40
lambda_memory_mb = 1536
graph_instance = "c5.2xlarge"
ps_instance = "c5.xlarge"
"""


def _hcl_value(v):
    """python-hcl2 >= 7 returns string literals with their quotes and escapes; older versions decode them."""
    if isinstance(v, str) and len(v) >= 2 and v[0] == v[-1] == '"':
        return json.loads(v).replace("$${", "${").replace("%%{", "%{")
    return v


def _load_hcl(path: Path) -> dict:
    with path.open() as fh:
        return {k: _hcl_value(v) for k, v in hcl2.load(fh).items() if not k.startswith("__")}


def _tf_variables() -> dict[str, dict]:
    out = {}
    for entry in hcl2.load((TF_ROOT / "variables.tf").open())["variable"]:
        for label, body in entry.items():
            out[_hcl_value(label)] = body
    return out


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    d = tmp_path_factory.mktemp("deploy")
    cfg = d / "config.toml"
    cfg.write_text(CONFIG)
    out = d / "out"
    assert main(["deploy", "render", "--config", str(cfg), "--run-id", RUN, "--out", str(out)]) == 0
    return {"dir": out, "config": cfg, "tfvars": _load_hcl(out / "dorylus.tfvars"),
            "json": json.loads((out / "deploy.json").read_text())}


@pytest.fixture(scope="module")
def fake_dorylus(tmp_path_factory):
    """A `dorylus` on PATH that prints its arguments, NUL-separated."""
    bin_dir = tmp_path_factory.mktemp("bin")
    exe = bin_dir / "dorylus"
    exe.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\0" "$a"; done\n')
    exe.chmod(0o755)
    return bin_dir


def _instance_env(fake_dorylus, partition=None) -> dict[str, str]:
    """What /etc/dorylus/env gives a process (infra/terraform/main.tf's environment plus the instance's index)."""
    env = {"PATH": f"{fake_dorylus}:/usr/bin:/bin", "DORYLUS_BOOTSTRAP": BOOT, "DORYLUS_RUN_ID": RUN,
           "NUM_PARTITIONS": str(P)}
    if partition is not None:
        env["PARTITION"] = str(partition)
    else:
        env["SHARD"] = "0"
    return env


def _run_sh(script: str, env: dict, *args: str) -> list[str]:
    proc = subprocess.run(["/bin/sh", "-c", script, "sh", *args], env=env, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    return ["dorylus", *proc.stdout.split("\0")[:-1]]


def _as_instance_runs(command: str, env: dict) -> list[str]:
    """The argv a command line becomes in the user data's run.sh (`set -eu; exec <command>`, /bin/sh)."""
    return _run_sh(f"set -eu\nexec {command}\n", env)


def _expected() -> dict[str, list[str]]:
    return role_commands(deploy.INSTANCE_CONFIG, BOOT, RUN, out=f"{deploy.INSTANCE_RUNS}/{RUN}", partitions=P,
                         workers=P, entry=["dorylus"])


def _kind_and_index(role: str) -> tuple[str, int | None]:
    m = re.fullmatch(r"(graph-server|tensor-worker)-(\d+)", role)
    return (m.group(1), int(m.group(2))) if m else (role, None)


# ------------------------------------------------------------------------------------------------ acceptance 2
def test_tfvars_commands_are_the_local_launchers(rendered, fake_dorylus):
    """Every role of the run: the rendered command line, run by /bin/sh with the instance's environment, is the
    argv `role_commands` gives the local launcher (entry normalized to `dorylus`)."""
    tfvars = rendered["tfvars"]
    expected = _expected()
    assert sorted(expected) == sorted(["param-server", *(f"graph-server-{p}" for p in range(P)),
                                       *(f"tensor-worker-{p}" for p in range(P))])
    for role, argv in expected.items():
        kind, index = _kind_and_index(role)
        command = tfvars[deploy.ROLE_VARIABLES[kind]]
        got = _as_instance_runs(command, _instance_env(fake_dorylus, index))
        assert got == argv, role
        # The same with the launcher's default entry point (python -m pipelines.cli), normalized.
        local = role_commands(deploy.INSTANCE_CONFIG, BOOT, RUN, out=f"{deploy.INSTANCE_RUNS}/{RUN}",
                              partitions=P, workers=P)[role]
        assert local[:3] == [local[0], "-m", "pipelines.cli"] and got[1:] == local[3:], role


def test_placeholder_substitution_matches_the_shell(rendered, fake_dorylus):
    """deploy.expand (plain substitution of the placeholders) and /bin/sh agree on every template."""
    for kind, argv in rendered["json"]["roles"].items():
        idx = 1 if kind in ("graph-server", "tensor-worker") else None
        env = _instance_env(fake_dorylus, idx)
        subst = {k: env.get(k, "") for k in deploy.PLACEHOLDERS}
        assert deploy.expand(argv["argv"], subst) == _as_instance_runs(argv["command"], env), kind
        assert argv["command"] == rendered["tfvars"][argv["terraform_variable"]]


def test_shell_words_survive_odd_characters(fake_dorylus):
    """Paths with spaces, quotes, $, backslashes and backticks stay literal; only the placeholders expand."""
    argv = ["dorylus", "graph-server", "--config", "/etc/my dir/it's \"x\".toml", "--out",
            "/runs/$DORYLUS_RUN_ID/a b$HOME`id`\\", "--partition", "$PARTITION", "--x", "$PARTITIONS", "", "-"]
    env = _instance_env(fake_dorylus, 5)
    subst = {k: env[k] for k in deploy.PLACEHOLDERS}
    got = _as_instance_runs(deploy.shell_join(argv), env)
    assert got == deploy.expand(argv, subst)
    assert got[5] == f"/runs/{RUN}/a b$HOME`id`\\" and got[7] == "5" and got[9] == "$PARTITIONS"


def test_roles_sh(rendered, fake_dorylus):
    """`sh roles.sh ROLE` runs the same argv (for machines Terraform did not create)."""
    script = (rendered["dir"] / "roles.sh").read_text()
    expected = _expected()
    for role in ("graph-server-2", "tensor-worker-0", "param-server"):
        kind, index = _kind_and_index(role)
        assert _run_sh(script, _instance_env(fake_dorylus, index), kind) == expected[role], role
    env = _instance_env(fake_dorylus, 0)
    del env["DORYLUS_RUN_ID"], env["NUM_PARTITIONS"]   # defaults: this rendering's
    driver = _run_sh(script, env, "driver")
    assert driver[driver.index("--run-id") + 1] == RUN and driver[driver.index("--worker-processes") + 1] == str(P)
    proc = subprocess.run(["/bin/sh", "-c", script, "sh", "nonsense"], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_rendered_argv_parse_with_the_real_cli(rendered, fake_dorylus):
    """The flags exist: every rendered argv parses with `dorylus`'s own parser, to the intended values."""
    parser = build_parser()
    roles = rendered["json"]["roles"]
    env = _instance_env(fake_dorylus, 2)
    subst = {k: env[k] for k in deploy.PLACEHOLDERS}
    for kind, r in roles.items():
        args = parser.parse_args(deploy.expand(r["argv"], subst)[1:])
        assert args.config == deploy.INSTANCE_CONFIG and args.bootstrap == BOOT and args.run_id == RUN
        assert args.out == f"{deploy.INSTANCE_RUNS}/{RUN}"
        assert args.command == ("train" if kind == "driver" else kind)
    g = parser.parse_args(deploy.expand(roles["graph-server"]["argv"], subst)[1:])
    assert g.partition == 2
    w = parser.parse_args(deploy.expand(roles["tensor-worker"]["argv"], subst)[1:])
    assert w.worker_id == 2
    d = parser.parse_args(deploy.expand(roles["driver"]["argv"], subst)[1:])
    # the driver: Kafka, no local roles, waits for one tensor-worker process per graph server
    assert d.transport == "kafka" and not d.spawn_local and d.worker_processes == P and d.resume is None


def test_tfvars_feed_the_terraform_variables(rendered):
    """The tfvars parse, set only declared variables, and satisfy their validation blocks (checked in Python)."""
    tfvars = rendered["tfvars"]
    declared = _tf_variables()
    assert set(tfvars) <= set(declared), f"undeclared: {set(tfvars) - set(declared)}"
    for kind, var in deploy.ROLE_VARIABLES.items():
        cmd = tfvars[var]
        assert cmd.strip().startswith("dorylus ") and "\n" not in cmd, var
    assert tfvars["graph_server_count"] == P and tfvars["param_server_count"] == 1
    assert tfvars["staleness"] == 1
    assert tfvars["lambda_memory_mb"] == 1536 and tfvars["lambdas_per_graph_server"] == 40
    assert tfvars["lambda_reserved_concurrency"] >= P * 40
    assert tfvars["graph_server_instance_type"] == "c5.2xlarge"
    assert tfvars["run_id"] == RUN and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", RUN)
    # The instance config is the engine's config with the deployment's changes, and loads as one.
    inst = deploy.load_config(rendered["dir"] / "config.toml")
    src = deploy.render(rendered["config"], run_id=RUN).source
    assert inst.partitions == src.partitions and inst.staleness == src.staleness and inst.model == src.model
    assert inst.transport == "kafka" and inst.data_dir == deploy.INSTANCE_DATA_DIR
    assert inst.function == "dorylus-tensor-worker"
    assert set(rendered["json"]["overrides"]) == {"transport", "data_dir", "function"}


def _terraform():
    return os.environ.get("DORYLUS_TERRAFORM") or shutil.which("terraform")


def _plan_variables(tmp_path: Path, tfvars_text: str) -> subprocess.CompletedProcess:
    """`terraform plan` over a copy of the root variables.tf alone: evaluates every validation block, no provider."""
    work = tmp_path / "vars"
    work.mkdir(exist_ok=True)
    shutil.copy(TF_ROOT / "variables.tf", work / "variables.tf")
    (work / "rendered.tfvars").write_text(tfvars_text)
    rc = tmp_path / "terraformrc"
    rc.write_text("")
    env = {**os.environ, "TF_CLI_CONFIG_FILE": str(rc), "CHECKPOINT_DISABLE": "1", "TF_IN_AUTOMATION": "1",
           "TF_INPUT": "0"}
    cmd = [_terraform(), "plan", "-no-color", "-input=false", "-lock=false", "-refresh=false",
           "-var", "region=us-east-1", "-var", 'availability_zones=["us-east-1a","us-east-1b"]',
           "-var", "lambda_image_tag=0123456789ab", "-var-file=rendered.tfvars"]
    return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(_terraform() is None, reason="no terraform binary (set DORYLUS_TERRAFORM or put it on PATH)")
def test_tfvars_pass_terraform_validation(rendered, tmp_path):
    text = (rendered["dir"] / "dorylus.tfvars").read_text()
    proc = _plan_variables(tmp_path, text)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # ... and the validation bites: a command that is not `dorylus ...` is refused.
    bad = re.sub(r'^(driver_command\s*=\s*")dorylus ', r"\1python -m pipelines.cli ", text, flags=re.M)
    assert bad != text
    proc = _plan_variables(tmp_path, bad)
    assert proc.returncode != 0 and "driver command must be" in proc.stdout + proc.stderr


def test_terraform_defaults_are_the_rendering(rendered):
    """The command lines do not depend on the config (only their number does), so Terraform's defaults must be
    exactly what `dorylus deploy render` produces: a drift check between the two sides."""
    declared = _tf_variables()
    for kind, var in deploy.ROLE_VARIABLES.items():
        assert _hcl_value(declared[var]["default"]) == rendered["tfvars"][var], var
    assert _hcl_value(declared["run_id"]["default"]) == deploy.DEFAULT_NAME


def test_reddit_example_config_renders_the_reddit_tfvars(tmp_path):
    out = tmp_path / "out"
    assert main(["deploy", "render", "--config", str(TF_ROOT / "examples" / "reddit.toml"), "--name",
                 "dorylus-reddit", "--out", str(out)]) == 0
    rendered = _load_hcl(out / "dorylus.tfvars")
    example = _load_hcl(TF_ROOT / "examples" / "reddit.tfvars")
    for key in ("name", "graph_server_count", "param_server_count", "graph_server_instance_type",
                "param_server_instance_type", "staleness", "lambda_memory_mb", "lambdas_per_graph_server",
                "lambda_reserved_concurrency"):
        assert rendered[key] == example[key], key


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("body,flags,fragment", [
    ('datasett = "x"\n', [], "unknown setting 'datasett'"),
    ('partitions = 0\n', [], "partitions must be >= 1"),
    ('partitions = 300\n', [], "exceeds the deployment's 256 graph servers"),
    ('staleness = 100\n', [], "staleness (100) exceeds"),
    ('prepared = "/data/prep"\n', [], "prepared: the Kafka roles load --dataset"),
    ('dataset = "/home/me/graph.npz"\n', [], "is a path on this machine"),
    ('graph_instance = "big"\n', [], "graph_instance: 'big' is not an EC2 instance type"),
    ('', ["--bootstrap", "not a host"], "--bootstrap 'not a host'"),
    ('', ["--run-id", "a/b"], "--run-id 'a/b'"),
    ('', ["--name", "Bad_Name"], "--name 'Bad_Name'"),
])
def test_config_errors_are_one_line_exit_2(tmp_path, capsys, body, flags, fragment):
    cfg = tmp_path / "c.toml"
    cfg.write_text(body)
    assert main(["deploy", "render", "--config", str(cfg), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("dorylus: error: ") and fragment in err, err
    assert not any(tmp_path.glob("out*"))


def test_missing_config_and_bad_flag(tmp_path, capsys):
    assert main(["deploy", "render", "--config", str(tmp_path / "nope.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["deploy", "render", "--config", "x.toml", "--format", "yaml"]) == 2
    assert "--format" in capsys.readouterr().err


def test_stdout_formats(rendered, capsys):
    assert main(["deploy", "render", "--config", str(rendered["config"]), "--run-id", RUN, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tfvars"] == rendered["json"]["tfvars"] and doc["partitions"] == P
    # deterministic: the default run id depends on the config only, so rendering twice changes nothing
    a = deploy.render(rendered["config"])
    b = deploy.render(rendered["config"])
    assert a.run_id == b.run_id and deploy.to_tfvars(a) == deploy.to_tfvars(b)


# ------------------------------------------------------------------------------------------------ cost estimate
def test_estimate_is_the_cost_models(capsys):
    from pipelines.engine.cost import load_prices

    prices = load_prices()
    cfg = deploy.render(TF_ROOT / "examples" / "reddit.toml", name="dorylus-reddit").config
    e = deploy.estimate(cfg, epoch_s=10.0, prices=prices)
    hour = e["per_hour_usd"]
    assert e["lambdas"] == 160
    assert hour["graph_servers"] == pytest.approx(2 * prices["ec2"]["c5.2xlarge"])
    assert hour["param_server"] == pytest.approx(prices["ec2"]["c5.xlarge"])
    assert hour["lambda_compute"] == pytest.approx(160 * 3600 * 2048 / 1024 * prices["lambda"]["gb_second"])
    assert hour["lambda_requests"] == pytest.approx(160 * 3600 * prices["lambda"]["per_million_requests"] / 1e6)
    assert e["per_epoch_usd"]["total"] == pytest.approx(hour["total"] * 10 / 3600)
    assert e["value_per_epoch"] == pytest.approx(1 / (10 * e["per_epoch_usd"]["total"]))
    half = deploy.estimate(cfg, lambda_busy=0.5, prices=prices)["per_hour_usd"]
    assert half["lambda_compute"] == pytest.approx(hour["lambda_compute"] / 2)
    assert math.isclose(half["graph_servers"], hour["graph_servers"])

    assert main(["deploy", "render", "--config", str(TF_ROOT / "examples" / "reddit.toml"), "--estimate",
                 "--epoch-s", "10", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["per_hour_usd"]["total"] == pytest.approx(hour["total"])
    assert main(["deploy", "render", "--config", str(TF_ROOT / "examples" / "reddit.toml"), "--estimate",
                 "--lambda-busy", "2"]) == 2
