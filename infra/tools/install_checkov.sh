#!/usr/bin/env bash
# Install checkov into its own virtual environment.
#
# checkov pins boto3/botocore/s3transfer, networkx and packaging to versions older than the ones the
# project's main environment uses (boto3 1.43, networkx 3.x, packaging 26), so installing it next to the
# project would downgrade them. It therefore lives in a private venv, by default
#   <repo>/.cache/venvs/checkov            (.cache/ is git-ignored)
# and tests/test_terraform.py finds it there (or through $DORYLUS_CHECKOV, or on PATH).
#
# Idempotent: if the venv already holds the pinned version, it does nothing.
#
# Usage: bash infra/tools/install_checkov.sh [VENV_DIR]
#   env CHECKOV_VERSION  (default: the pin below)
#   env PYTHON           (default: python3.11, else python3) interpreter used to create the venv
set -euo pipefail

CHECKOV_VERSION="${CHECKOV_VERSION:-3.3.30}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV_DIR="${1:-${REPO_ROOT}/.cache/venvs/checkov}"

if [[ -z "${PYTHON:-}" ]]; then
  if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi

installed_version() {
  "${VENV_DIR}/bin/python" - <<'PY' 2>/dev/null || true
import importlib.metadata as md
print(md.version("checkov"))
PY
}

if [[ -x "${VENV_DIR}/bin/checkov" && "$(installed_version)" == "${CHECKOV_VERSION}" ]]; then
  echo "checkov ${CHECKOV_VERSION} already installed in ${VENV_DIR}"
  exit 0
fi

echo "installing checkov ${CHECKOV_VERSION} into ${VENV_DIR} (python: ${PYTHON})"
mkdir -p "$(dirname "${VENV_DIR}")"
if [[ ! -x "${VENV_DIR}/bin/python" ]]; then
  "${PYTHON}" -m venv "${VENV_DIR}"
fi
"${VENV_DIR}/bin/python" -m pip install --disable-pip-version-check --quiet --upgrade pip
"${VENV_DIR}/bin/python" -m pip install --disable-pip-version-check --quiet "checkov==${CHECKOV_VERSION}"
"${VENV_DIR}/bin/checkov" --version
echo "checkov installed: ${VENV_DIR}/bin/checkov"
