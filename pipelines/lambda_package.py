"""`dorylus lambda package`: the deployment artifacts of the tensor-worker Lambda function.

1. `dorylus-lambda-image.tar.gz`: the container-image build context, the artifact to deploy. The Dockerfile
   (`infra/lambda/Dockerfile`, at the root of the tarball), `pyproject.toml` and the project's `ops/` and
   `schemas/` (the handler and what it imports). Build and push with
   `docker build -t IMAGE - < dorylus-lambda-image.tar.gz` (or `docker buildx build --platform linux/amd64 ...`).
2. `dorylus-lambda-code.zip`: `ops/` + `schemas/` alone, a zip-deployment code package. It is small, but a zip
   function must carry its dependencies too (as the package or layers), and numpy + jax + jaxlib + pyarrow
   unzipped are far over Lambda's 250 MB limit (see `size_report.json`), which is why the image is the artifact.
3. `size_report.json`: sizes of both, of the dependencies as installed here, and the limits.
"""
from __future__ import annotations

import io
import json
import os
import tarfile
import time
import zipfile
from pathlib import Path

from pipelines.data.registry import sha256_file

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "infra" / "lambda" / "Dockerfile"
CODE_PACKAGES = ("ops", "schemas")
#: distributions the handler needs at run time (jax pulls in jaxlib, ml_dtypes, opt_einsum and scipy)
RUNTIME_DISTS = ("numpy", "jax", "jaxlib", "pyarrow", "scipy", "ml_dtypes", "opt_einsum")
ZIP_LIMIT_UNZIPPED = 250 * 1024 ** 2        # function + layers, unzipped
ZIP_LIMIT_DIRECT_UPLOAD = 50 * 1024 ** 2    # zipped, uploaded with the API (larger: through S3)
IMAGE_LIMIT = 10 * 1024 ** 3                # container image, uncompressed
_FIXED_MTIME = 315532800                    # 1980-01-01: reproducible archives


def _sources(root: Path, packages=CODE_PACKAGES) -> list[tuple[str, Path]]:
    out = []
    for pkg in packages:
        for p in sorted((root / pkg).rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo"):
                out.append((p.relative_to(root).as_posix(), p))
    if not out:
        raise FileNotFoundError(f"no sources of {packages} under {root}")
    return out


def build_zip(path: Path, root: Path = REPO) -> dict:
    files = _sources(root)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for name, p in files:
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            z.writestr(info, p.read_bytes())
    return {"path": str(path), "files": len(files), "bytes": path.stat().st_size,
            "unzipped_bytes": sum(p.stat().st_size for _, p in files), "sha256": sha256_file(path)}


def build_context(path: Path, root: Path = REPO, dockerfile: Path = DOCKERFILE) -> dict:
    if not dockerfile.is_file():
        raise FileNotFoundError(f"Dockerfile {dockerfile} not found")
    members = [("Dockerfile", dockerfile), ("pyproject.toml", root / "pyproject.toml")]
    if (root / "README.md").is_file():
        members.append(("README.md", root / "README.md"))
    members += _sources(root)

    def add(tar, name, data: bytes):
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode, info.uid, info.gid = len(data), _FIXED_MTIME, 0o644, 0, 0
        tar.addfile(info, io.BytesIO(data))

    with open(path, "wb") as raw:
        import gzip

        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=_FIXED_MTIME) as gz:
            with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
                for name, p in members:
                    add(tar, name, p.read_bytes())
    return {"path": str(path), "files": len(members), "bytes": path.stat().st_size, "sha256": sha256_file(path),
            "dockerfile": str(dockerfile.relative_to(root)) if dockerfile.is_relative_to(root) else str(dockerfile)}


def installed_sizes(dists=RUNTIME_DISTS) -> dict:
    """Bytes on disk of each installed distribution (its RECORD: package files and bundled .libs)."""
    from importlib import metadata

    out = {}
    for name in dists:
        try:
            d = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            out[name] = None
            continue
        total = 0
        for f in d.files or []:
            p = Path(d.locate_file(f))
            try:
                total += p.stat().st_size
            except OSError:
                pass
        out[name] = {"version": d.version, "bytes": total}
    return out


def package(out: Path, root: Path = REPO) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    image = build_context(out / "dorylus-lambda-image.tar.gz", root)
    code = build_zip(out / "dorylus-lambda-code.zip", root)
    deps = installed_sizes()
    core = sum(v["bytes"] for k, v in deps.items() if v and k in ("numpy", "jax", "jaxlib", "pyarrow"))
    every = sum(v["bytes"] for v in deps.values() if v)
    report = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "image_context": image,
        "code_zip": code,
        "dependencies_installed_here": deps,
        "numpy_jax_jaxlib_pyarrow_bytes": core,
        "all_runtime_dependencies_bytes": every,
        "limits": {"zip_unzipped_with_layers": ZIP_LIMIT_UNZIPPED, "zip_direct_upload": ZIP_LIMIT_DIRECT_UPLOAD,
                   "image_uncompressed": IMAGE_LIMIT},
        "zip_deployment_fits": code["unzipped_bytes"] + every <= ZIP_LIMIT_UNZIPPED,
        "artifact": "container image (build context: dorylus-lambda-image.tar.gz)",
    }
    tmp = out / "size_report.json.tmp"
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, out / "size_report.json")
    return report


def _mb(n) -> str:
    if n is None:
        return "-"
    return f"{n / 1024 ** 2:8.1f} MB" if n >= 1024 ** 2 else f"{n / 1024:8.1f} KB"


def format_report(r: dict) -> str:
    lines = [f"image build context  {r['image_context']['path']}  {_mb(r['image_context']['bytes'])}  "
             f"({r['image_context']['files']} files)",
             f"code zip (ops+schemas) {r['code_zip']['path']}  {_mb(r['code_zip']['bytes'])} zipped, "
             f"{_mb(r['code_zip']['unzipped_bytes'])} unzipped",
             "dependencies as installed here (unzipped):"]
    for k, v in r["dependencies_installed_here"].items():
        lines.append(f"  {k:<12} {'(not installed)' if v is None else v['version']:<14} "
                     f"{_mb(None if v is None else v['bytes'])}")
    lim = r["limits"]["zip_unzipped_with_layers"]
    lines.append(f"  numpy+jax+jaxlib+pyarrow {_mb(r['numpy_jax_jaxlib_pyarrow_bytes'])}; with scipy, ml_dtypes, "
                 f"opt_einsum {_mb(r['all_runtime_dependencies_bytes'])}; zip limit {_mb(lim)} -> "
                 f"{'fits' if r['zip_deployment_fits'] else 'does not fit'}")
    lines.append(f"artifact: {r['artifact']}")
    return "\n".join(lines)


def cmd_package(args) -> int:
    r = package(Path(args.out))
    print(format_report(r))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("lambda", help="the tensor-worker Lambda function")
    sub = p.add_subparsers(dest="lambda_command", required=True, parser_class=type(p))
    k = sub.add_parser("package", help="build the deployment artifacts (image build context, code zip, sizes)")
    k.add_argument("--out", default="dist/lambda", help="output directory (default dist/lambda)")
    k.set_defaults(func=cmd_package)
