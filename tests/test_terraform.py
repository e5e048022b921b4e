"""Static checks of the AWS deployment in infra/ (Terraform, the Lambda Dockerfile).

- every .tf file parses (python-hcl2); every variable has a type and a description; every module input is wired;
- checkov (terraform + dockerfile frameworks) reports 0 failed checks, and every skip carries a written reason;
- when a terraform binary is available: `terraform fmt -check`; when the aws provider is available too (a local
  plugin directory: the public registry is unreachable here), `terraform init -backend=false`, `validate` and
  `terraform test` (mocked provider) with the Reddit example.

checkov lives in its own venv (it pins boto3/botocore, networkx and packaging below what the project uses):
`bash infra/tools/install_checkov.sh` installs it to .cache/venvs/checkov. The checkov test FAILS when checkov is
missing, it does not skip. Overrides: DORYLUS_CHECKOV (checkov binary), DORYLUS_TERRAFORM (terraform binary),
DORYLUS_TF_PLUGIN_DIR (provider plugin directory, default /opt/tf-plugins when it holds hashicorp/aws).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import hcl2
import pytest

REPO = Path(__file__).resolve().parents[1]
INFRA = REPO / "infra"
TF_ROOT = INFRA / "terraform"
MODULES_DIR = TF_ROOT / "modules"
DOCKERFILE = INFRA / "lambda" / "Dockerfile"
REDDIT_TFVARS = TF_ROOT / "examples" / "reddit.tfvars"
CHECKOV_VENV_BIN = REPO / ".cache" / "venvs" / "checkov" / "bin" / "checkov"
DEFAULT_TF_PLUGIN_DIR = Path("/opt/tf-plugins")

MODULE_META_ARGS = {"source", "version", "providers", "count", "for_each", "depends_on"}
EXPECTED_MODULES = {"network", "kafka", "tensor_workers", "compute", "storage"}


# ---------------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------------


def _unquote(value):
    """python-hcl2 >= 7 keeps the quotes of string literals and block labels; older versions drop them."""
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


def _tf_files(directory: Path = INFRA) -> list[Path]:
    return sorted(p for p in directory.rglob("*.tf") if ".terraform" not in p.parts)


def _load(path: Path) -> dict:
    with path.open() as fh:
        return hcl2.load(fh)


def _blocks(doc: dict, kind: str) -> dict[str, dict]:
    """{label: body} of the single-label blocks (variable, module, output) of one parsed file."""
    out: dict[str, dict] = {}
    for entry in doc.get(kind, []):
        for label, body in entry.items():
            if not label.startswith("__"):  # python-hcl2 8 adds __comments__ / __is_block__ entries
                out[_unquote(label)] = body
    return out


def _dir_blocks(directory: Path, kind: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for path in sorted(directory.glob("*.tf")):
        for label, body in _blocks(_load(path), kind).items():
            assert label not in out, f"{kind} {label!r} declared twice in {directory}"
            out[label] = body
    return out


def _module_dirs() -> list[Path]:
    return sorted(p for p in MODULES_DIR.iterdir() if p.is_dir())


def _terraform_dirs() -> list[Path]:
    return [TF_ROOT, *_module_dirs()]


def _find_checkov() -> str | None:
    env = os.environ.get("DORYLUS_CHECKOV")
    if env:
        return env
    if CHECKOV_VENV_BIN.exists():
        return str(CHECKOV_VENV_BIN)
    return shutil.which("checkov")


def _find_terraform() -> str | None:
    return os.environ.get("DORYLUS_TERRAFORM") or shutil.which("terraform")


def _find_plugin_dir() -> Path | None:
    env = os.environ.get("DORYLUS_TF_PLUGIN_DIR")
    candidates = [Path(env)] if env else [DEFAULT_TF_PLUGIN_DIR]
    for candidate in candidates:
        if (candidate / "registry.terraform.io" / "hashicorp" / "aws").is_dir():
            return candidate
    return None


def _terraform_env(tmp_path: Path) -> dict[str, str]:
    cli_config = tmp_path / "terraformrc"
    cli_config.write_text("")
    env = dict(os.environ)
    env.update(
        TF_IN_AUTOMATION="1",
        TF_INPUT="0",
        CHECKPOINT_DISABLE="1",  # no version check against the (unreachable) HashiCorp checkpoint service
        TF_CLI_CONFIG_FILE=str(cli_config),
    )
    env.pop("TF_PLUGIN_CACHE_DIR", None)
    return env


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------------------------------------------------
# structure
# ---------------------------------------------------------------------------------------------------------------------


def test_layout():
    assert {p.name for p in _module_dirs()} == EXPECTED_MODULES
    for directory in _terraform_dirs():
        for name in ("main.tf", "variables.tf", "outputs.tf"):
            assert (directory / name).is_file(), f"{directory / name} is missing"
    assert list((TF_ROOT / "templates").glob("*.sh.tftpl")), "no user-data templates/*.sh.tftpl"
    assert REDDIT_TFVARS.is_file()
    assert DOCKERFILE.is_file()
    assert (TF_ROOT / "README.md").is_file()
    assert (INFRA / "tools" / "install_checkov.sh").is_file()


@pytest.mark.parametrize("path", _tf_files(), ids=lambda p: str(p.relative_to(INFRA)))
def test_tf_file_parses(path: Path):
    doc = _load(path)
    assert isinstance(doc, dict)


def test_tfvars_and_tftest_files_parse():
    for path in [*TF_ROOT.rglob("*.tfvars"), *TF_ROOT.rglob("*.tftest.hcl")]:
        assert isinstance(_load(path), dict), path


@pytest.mark.parametrize("directory", _terraform_dirs(), ids=lambda p: str(p.relative_to(INFRA)))
def test_variables_have_type_and_description(directory: Path):
    variables = _dir_blocks(directory, "variable")
    assert variables, f"no variables in {directory}"
    for name, body in variables.items():
        assert body.get("type"), f"{directory.name}: variable {name!r} has no type"
        description = _unquote(body.get("description") or "")
        assert isinstance(description, str) and description.strip(), f"{directory.name}: variable {name!r} has no description"


@pytest.mark.parametrize("directory", _terraform_dirs(), ids=lambda p: str(p.relative_to(INFRA)))
def test_outputs_have_description(directory: Path):
    for name, body in _dir_blocks(directory, "output").items():
        assert _unquote(body.get("description") or "").strip(), f"{directory.name}: output {name!r} has no description"


def test_root_variables_have_validation():
    """The inputs the issue names are validated (region, instance types and counts, Lambda settings, staleness, dataset)."""
    variables = _dir_blocks(TF_ROOT, "variable")
    must_validate = [
        "region",
        "graph_server_instance_type",
        "graph_server_count",
        "param_server_instance_type",
        "param_server_count",
        "lambda_memory_mb",
        "lambda_timeout_s",
        "lambda_reserved_concurrency",
        "lambdas_per_graph_server",
        "staleness",
        "dataset_uri",
    ]
    for name in must_validate:
        assert name in variables, f"root variable {name!r} is missing"
        assert variables[name].get("validation"), f"root variable {name!r} has no validation block"
    assert "default" not in variables["region"], "the region must not be hard-coded as a default"


def test_module_inputs_are_wired():
    modules = _dir_blocks(TF_ROOT, "module")
    called = set()
    for name, body in modules.items():
        source = _unquote(body["source"])
        assert source.startswith("./modules/"), f"module {name!r}: unexpected source {source!r}"
        module_dir = (TF_ROOT / source).resolve()
        called.add(module_dir.name)
        declared = _dir_blocks(module_dir, "variable")
        passed = {k for k in body if k not in MODULE_META_ARGS and not k.startswith("__")}
        unknown = passed - set(declared)
        assert not unknown, f"module {name!r} is passed undeclared inputs {sorted(unknown)}"
        required = {v for v, b in declared.items() if "default" not in b}
        missing = required - passed
        assert not missing, f"module {name!r} does not set required inputs {sorted(missing)}"
    assert called == EXPECTED_MODULES


def test_reddit_example():
    tfvars = {k: _unquote(v) for k, v in _load(REDDIT_TFVARS).items() if not k.startswith("__")}
    declared = _dir_blocks(TF_ROOT, "variable")
    unknown = set(tfvars) - set(declared)
    assert not unknown, f"reddit.tfvars sets undeclared variables {sorted(unknown)}"
    assert tfvars["graph_server_count"] == 2
    assert tfvars["graph_server_instance_type"] == "c5.2xlarge"
    assert tfvars["lambdas_per_graph_server"] == 80
    assert tfvars["lambda_reserved_concurrency"] >= 2 * 80
    # Every required root variable except the image tag (a per-build value passed with -var) is set.
    required = {v for v, b in declared.items() if "default" not in b}
    assert required - set(tfvars) == {"lambda_image_tag"}


def test_nothing_hard_coded():
    account = re.compile(r"(?<![0-9])[0-9]{12}(?![0-9])")
    ami = re.compile(r"\bami-[0-9a-f]{8,17}\b")
    region = re.compile(r"\b(us|eu|ap|sa|ca|me|af|il|mx)-(east|west|north|south|central|northeast|southeast|southwest)-[0-9]\b")
    access_key = re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b")
    for path in _tf_files(TF_ROOT):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(INFRA)}:{lineno}"
            assert not account.search(line), f"{where}: hard-coded account id?"
            assert not access_key.search(line), f"{where}: hard-coded access key"
            if "description" in line or "error_message" in line:
                continue
            assert not ami.search(line), f"{where}: hard-coded AMI"
            assert not region.search(line), f"{where}: hard-coded region"
    provider = _dir_blocks(TF_ROOT, "provider")["aws"]
    assert _unquote(provider["region"]) == "${var.region}"
    assert not {"access_key", "secret_key", "token", "profile"} & set(provider)


def test_user_data_template():
    """The template runs the command line it is given, with the partition in its environment."""
    template = (TF_ROOT / "templates" / "server.sh.tftpl").read_text()
    assert template.startswith("#!/bin/bash")
    for name in ("command", "environment", "image_uri", "config_uri", "region", "registry", "log_group", "log_stream"):
        assert re.search(r"\$\{\s*" + name + r"\b", template) or f"in {name}" in template, f"template ignores {name}"
    assert "exec ${command}" in template
    assert "<<'DORYLUS_RUN'" in template, "run.sh must be written with a quoted heredoc so $PARTITION expands at run time"
    compute = (MODULES_DIR / "compute" / "main.tf").read_text()
    for key in ("role", "title", "region", "registry", "image_uri", "config_uri", "log_group", "log_stream", "command", "environment"):
        assert re.search(r"^\s+" + key + r"\s+=", compute, re.M), f"compute does not pass {key!r} to the template"
    defaults = _dir_blocks(TF_ROOT, "variable")
    assert _unquote(defaults["graph_server_command"]["default"]).startswith("dorylus graph-server --partition")
    assert _unquote(defaults["param_server_command"]["default"]).startswith("dorylus param-server")


def test_dockerfile():
    text = DOCKERFILE.read_text()
    instructions = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert instructions[0] == "FROM public.ecr.aws/lambda/python:3.11"
    assert any(i.startswith("RUN python -m pip install") for i in instructions)
    users = [i.split()[1] for i in instructions if i.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in {"root", "0"}
    assert any(i.startswith("HEALTHCHECK ") for i in instructions)
    assert instructions[-1] == 'CMD ["ops.lambda_handler.handler"]'


def test_install_checkov_script():
    script = INFRA / "tools" / "install_checkov.sh"
    text = script.read_text()
    assert re.search(r'CHECKOV_VERSION="\$\{CHECKOV_VERSION:-[0-9]+\.[0-9]+\.[0-9]+\}"', text), "checkov version not pinned"
    assert ".cache/venvs/checkov" in text
    subprocess.run(["bash", "-n", str(script)], check=True)


# ---------------------------------------------------------------------------------------------------------------------
# checkov
# ---------------------------------------------------------------------------------------------------------------------

SKIP_RE = re.compile(r"checkov:skip=([A-Z0-9_]+)(?::(.*))?")


def test_checkov_skips_carry_reasons():
    files = [*_tf_files(INFRA), DOCKERFILE]
    for path in files:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            match = SKIP_RE.search(line)
            if not match:
                continue
            check_id, reason = match.group(1), (match.group(2) or "").strip()
            assert re.fullmatch(r"CKV2?_[A-Z]+_[0-9]+", check_id), f"{path}:{lineno}: malformed check id {check_id}"
            assert len(reason) >= 20, f"{path}:{lineno}: skip of {check_id} has no written reason"


def test_checkov_passes():
    checkov = _find_checkov()
    if checkov is None or not (Path(checkov).is_file() or shutil.which(checkov)):
        pytest.fail(f"checkov not found ({checkov}): run `bash infra/tools/install_checkov.sh` (or set DORYLUS_CHECKOV)")
    env = dict(os.environ)
    env.update(BC_SKIP_MAPPING="TRUE", LOG_LEVEL="WARNING")
    env.pop("CHECKOV_NO_OUTPUT", None)
    cmd = [
        checkov,
        "--directory", str(INFRA),
        "--framework", "terraform", "dockerfile",
        "--skip-download",
        "--output", "json",
        "--compact",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip(), f"checkov printed nothing (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    reports = json.loads(proc.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    by_type = {r["check_type"]: r for r in reports}
    assert set(by_type) == {"terraform", "dockerfile"}, f"checkov ran {sorted(by_type)}"

    failures = []
    for check_type, report in by_type.items():
        summary = report["summary"]
        assert summary["parsing_errors"] == 0, f"{check_type}: checkov could not parse {report['results'].get('parsing_errors')}"
        assert summary["passed"] > 0, f"{check_type}: no check passed"
        for failed in report["results"].get("failed_checks", []):
            failures.append(f"{failed['check_id']} {failed['resource']} ({failed['file_path']}): {failed['check_name']}")
        for skipped in report["results"].get("skipped_checks", []):
            reason = (skipped.get("check_result") or {}).get("suppress_comment") or ""
            assert reason.strip(), f"{skipped['check_id']} on {skipped['resource']} is skipped without a reason"
    assert not failures, "checkov failed checks:\n" + "\n".join(failures)


# ---------------------------------------------------------------------------------------------------------------------
# terraform CLI (when available)
# ---------------------------------------------------------------------------------------------------------------------


def test_terraform_fmt(tmp_path: Path):
    terraform = _find_terraform()
    if terraform is None:
        pytest.skip("no terraform binary (set DORYLUS_TERRAFORM or put terraform on PATH)")
    proc = _run([terraform, "fmt", "-check", "-recursive", "-diff", "-no-color"], cwd=TF_ROOT, env=_terraform_env(tmp_path), timeout=60)
    assert proc.returncode == 0, f"terraform fmt -check found unformatted files:\n{proc.stdout}\n{proc.stderr}"


def test_terraform_validate_and_test(tmp_path: Path):
    terraform = _find_terraform()
    if terraform is None:
        pytest.skip("no terraform binary (set DORYLUS_TERRAFORM or put terraform on PATH)")
    plugin_dir = _find_plugin_dir()
    if plugin_dir is None:
        pytest.skip("no local hashicorp/aws provider (DORYLUS_TF_PLUGIN_DIR); the Terraform registry is unreachable")
    env = _terraform_env(tmp_path)
    # Work on a copy so that .terraform/ and the lock file never land in the source tree.
    work = tmp_path / "terraform"
    shutil.copytree(TF_ROOT, work, ignore=shutil.ignore_patterns(".terraform", ".terraform.lock.hcl", "*.tfstate*"))

    steps = [
        [terraform, "init", "-backend=false", "-input=false", "-no-color", f"-plugin-dir={plugin_dir}"],
        [terraform, "validate", "-no-color"],
        [terraform, "test", "-no-color", f"-var-file={work / 'examples' / 'reddit.tfvars'}"],
    ]
    for cmd in steps:
        proc = _run(cmd, cwd=work, env=env, timeout=240)
        assert proc.returncode == 0, f"{' '.join(cmd[:2])} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
