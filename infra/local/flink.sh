#!/usr/bin/env bash
# The Beam Flink job server (with its embedded Flink cluster) for Beam pipelines on the FlinkRunner, offline.
#
#   infra/local/flink.sh fetch [--force]    # fetch (or assemble) the job-server jar into the cache; prints its path
#   infra/local/flink.sh path               # print the cached jar's path; exit 3 when nothing is cached
#   infra/local/flink.sh info               # print the cache pointer (JSON: jar, kind, flink/beam versions)
#   infra/local/flink.sh smoke              # run a trivial Beam pipeline on the FlinkRunner, print the seconds taken
#   infra/local/flink.sh clean              # remove the cache
#
# Options (any subcommand):
#   --flink-version V   Flink minor version (default $DORYLUS_FLINK_VERSION or 1.19)
#   --beam-version V    Beam version of the official job-server jar (default: the installed apache_beam's)
#   --fallback-beam-version V
#                       Beam version of the runner that is assembled when the official jar is missing
#                       (default $DORYLUS_FLINK_FALLBACK_BEAM_VERSION or 2.62.0)
#   --no-assemble       fail instead of assembling when the official jar is not in Maven Central
#   --cache-dir DIR     default $DORYLUS_CACHE/beam or <repo>/.cache/beam
#
# fetch, step 1: `mvn dependency:copy` of the official shaded job server
#     org.apache.beam:beam-runners-flink-<flink>-job-server:<beam>
# (Python's FlinkRunner starts it with `java -jar JAR --flink-master [local] ...`: an embedded Flink mini cluster).
# fetch, step 2, only when step 1 finds nothing (the Maven Central this project reaches holds no Beam *job-server*
# jars at all, and no Beam 2.77 Java artifacts): assemble an equivalent job server from the non-shaded runner
#     org.apache.beam:beam-runners-flink-<flink>:<fallback beam>
# and its ~160 runtime dependencies (`mvn dependency:copy-dependencies`, ~150 MB), plus a 2 kB launcher jar whose
# manifest names FlinkJobServerDriver as Main-Class and every dependency in Class-Path, so `java -jar` works.
# The assembled server is an older Beam than the Python SDK; the portable job/Fn APIs have stayed compatible
# (tests/test_beam_prepare.py compares Flink's output with the DirectRunner's), but step 1 is what to use where the
# official jar exists. Either way, <cache>/flink-job-server.json records which jar was chosen;
# pipelines/beam/runners.py reads it ($DORYLUS_FLINK_JOB_SERVER_JAR overrides).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-python3}"

FLINK_VERSION="${DORYLUS_FLINK_VERSION:-1.19}"
BEAM_VERSION="${DORYLUS_BEAM_VERSION:-}"
FALLBACK_BEAM_VERSION="${DORYLUS_FLINK_FALLBACK_BEAM_VERSION:-2.62.0}"
SLF4J_VERSION="1.7.30"
DEP_PLUGIN_VERSION="3.8.1"
if [[ -n "${DORYLUS_CACHE:-}" ]]; then CACHE_DIR="$DORYLUS_CACHE/beam"; else CACHE_DIR="$REPO/.cache/beam"; fi
ASSEMBLE=1
FORCE=0

die() { echo "flink.sh: $*" >&2; exit 1; }
log() { echo "flink.sh: $*" >&2; }

cmd="${1:-}"
[[ -n "$cmd" ]] || die "usage: flink.sh fetch|path|info|smoke|clean [options] (see the header of $0)"
shift
while [[ $# -gt 0 ]]; do
  case "$1" in
    --flink-version) FLINK_VERSION="$2"; shift 2 ;;
    --beam-version) BEAM_VERSION="$2"; shift 2 ;;
    --fallback-beam-version) FALLBACK_BEAM_VERSION="$2"; shift 2 ;;
    --no-assemble) ASSEMBLE=0; shift ;;
    --force) FORCE=1; shift ;;
    --cache-dir) CACHE_DIR="$2"; shift 2 ;;
    -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
    *) die "unknown option: $1" ;;
  esac
done

POINTER="$CACHE_DIR/flink-job-server.json"

sdk_version() {
  "$PYTHON" -c 'import warnings, logging; logging.disable(logging.WARNING); import apache_beam; print(apache_beam.__version__)' 2>/dev/null
}

# write the pointer file atomically: jar path, kind, versions
write_pointer() {  # jar kind flink beam
  local sdk
  sdk="$(sdk_version || echo unknown)"
  cat >"$POINTER.tmp" <<EOF
{"jar": "$1", "kind": "$2", "flink_version": "$3", "beam_version": "$4", "python_sdk_version": "$sdk",
 "fetched": "$(date -u +%FT%TZ)"}
EOF
  mv "$POINTER.tmp" "$POINTER"
}

pointer_jar() {
  [[ -f "$POINTER" ]] || return 1
  "$PYTHON" - "$POINTER" <<'EOF'
import json, os, sys
p = json.load(open(sys.argv[1]))
jar = p.get("jar", "")
if not os.path.isfile(jar):
    sys.exit(1)
if p.get("kind") == "assembled" and not os.path.isfile(os.path.join(os.path.dirname(jar), "lib", ".complete")):
    sys.exit(1)
print(jar)
EOF
}

try_official() {  # -> 0 and sets JAR when the official jar was copied
  local artifact="beam-runners-flink-$FLINK_VERSION-job-server"
  local dest="$CACHE_DIR/$artifact-$BEAM_VERSION.jar"
  if [[ -f "$dest" && $FORCE -eq 0 ]]; then JAR="$dest"; return 0; fi
  log "fetching org.apache.beam:$artifact:$BEAM_VERSION from Maven Central"
  local upd=()
  [[ $FORCE -eq 1 ]] && upd=(-U)
  if mvn -B -q "${upd[@]}" "org.apache.maven.plugins:maven-dependency-plugin:$DEP_PLUGIN_VERSION:copy" \
      -Dartifact="org.apache.beam:$artifact:$BEAM_VERSION:jar" -DoutputDirectory="$CACHE_DIR" \
      -Dmdep.overWriteReleases=true >"$CACHE_DIR/mvn-official.log" 2>&1 && [[ -f "$dest" ]]; then
    JAR="$dest"
    return 0
  fi
  log "not in Maven Central: org.apache.beam:$artifact:$BEAM_VERSION ($(grep -m1 -oE 'Could not find artifact[^ ]* [^ ]*|not found in [^ ]*|Could not transfer[^:]*' "$CACHE_DIR/mvn-official.log" || echo "see $CACHE_DIR/mvn-official.log"))"
  return 1
}

assemble() {  # -> sets JAR
  local name="beam-runners-flink-$FLINK_VERSION-job-server-$FALLBACK_BEAM_VERSION"
  local dir="$CACHE_DIR/assembled-flink-$FLINK_VERSION-beam-$FALLBACK_BEAM_VERSION"
  local jar="$dir/$name-assembled.jar"
  if [[ -f "$dir/lib/.complete" && -f "$jar" && $FORCE -eq 0 ]]; then JAR="$jar"; return 0; fi
  log "assembling a job server from org.apache.beam:beam-runners-flink-$FLINK_VERSION:$FALLBACK_BEAM_VERSION and its dependencies"
  mkdir -p "$dir"
  cat >"$dir/pom.xml" <<EOF
<?xml version="1.0" encoding="UTF-8"?>
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>dorylus.local</groupId>
  <artifactId>beam-flink-job-server-classpath</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.apache.beam</groupId><artifactId>beam-runners-flink-$FLINK_VERSION</artifactId><version>$FALLBACK_BEAM_VERSION</version></dependency>
    <!-- the official job server bundles an slf4j binding too; warn level is set by pipelines/beam/runners.py -->
    <dependency><groupId>org.slf4j</groupId><artifactId>slf4j-simple</artifactId><version>$SLF4J_VERSION</version></dependency>
  </dependencies>
  <build>
    <plugins>
      <plugin>
        <groupId>org.apache.maven.plugins</groupId>
        <artifactId>maven-dependency-plugin</artifactId>
        <version>$DEP_PLUGIN_VERSION</version>
      </plugin>
    </plugins>
  </build>
</project>
EOF
  rm -rf "$dir/lib.tmp"
  local upd=()
  [[ $FORCE -eq 1 ]] && upd=(-U)
  if ! mvn -q -B "${upd[@]}" -f "$dir/pom.xml" dependency:copy-dependencies \
        -DoutputDirectory="$dir/lib.tmp" -DincludeScope=runtime >"$dir/mvn.log" 2>&1; then
    tail -n 30 "$dir/mvn.log" >&2
    die "mvn dependency:copy-dependencies failed (full log: $dir/mvn.log)"
  fi
  ls "$dir/lib.tmp"/beam-runners-flink-"$FLINK_VERSION"-"$FALLBACK_BEAM_VERSION".jar >/dev/null 2>&1 \
    || die "beam-runners-flink-$FLINK_VERSION jar missing after mvn (log: $dir/mvn.log)"
  rm -rf "$dir/lib"
  mv "$dir/lib.tmp" "$dir/lib"
  # launcher: Class-Path entries are relative to the launcher jar; manifest lines wrap at 72 bytes
  "$PYTHON" - "$dir" <<'EOF'
import os, sys
d = sys.argv[1]
jars = sorted(j for j in os.listdir(os.path.join(d, "lib")) if j.endswith(".jar"))
def header(name, value):
    b = f"{name}: {value}".encode()
    out, first = [], True
    while b:
        n = 72 if first else 71
        out.append((b"" if first else b" ") + b[:n])
        b, first = b[n:], False
    return b"\r\n".join(out) + b"\r\n"
m = (b"Manifest-Version: 1.0\r\n"
     + header("Main-Class", "org.apache.beam.runners.flink.FlinkJobServerDriver")
     + header("Class-Path", " ".join("lib/" + j for j in jars))
     + b"Created-By: dorylus infra/local/flink.sh\r\n\r\n")
open(os.path.join(d, "MANIFEST.MF"), "wb").write(m)
EOF
  rm -f "$jar.tmp"
  (cd "$dir" && jar --create --file "$jar.tmp" --manifest MANIFEST.MF) || die "jar --create failed (needs a JDK)"
  mv "$jar.tmp" "$jar"
  date -u +%FT%TZ >"$dir/lib/.complete"
  log "assembled $(ls "$dir"/lib/*.jar | wc -l) jars ($(du -sh "$dir/lib" | cut -f1)) behind $jar"
  log "note: Beam $FALLBACK_BEAM_VERSION (Java) job server for the Beam $(sdk_version || echo '?') Python SDK"
  JAR="$jar"
}

do_fetch() {
  mkdir -p "$CACHE_DIR"
  exec 9>"$CACHE_DIR/.fetch.lock"
  flock 9
  local cached
  if [[ $FORCE -eq 0 ]] && cached="$(pointer_jar)"; then flock -u 9; echo "$cached"; return 0; fi
  command -v mvn >/dev/null || die "mvn not found (needed once to fetch the Beam Flink job server)"
  command -v java >/dev/null || die "java not found (the Flink job server needs a JVM, Java 11+)"
  [[ -n "$BEAM_VERSION" ]] || BEAM_VERSION="$(sdk_version)" || die "apache_beam is not importable; pass --beam-version"
  JAR=""
  if try_official; then
    write_pointer "$JAR" official "$FLINK_VERSION" "$BEAM_VERSION"
  elif [[ $ASSEMBLE -eq 1 ]]; then
    assemble
    write_pointer "$JAR" assembled "$FLINK_VERSION" "$FALLBACK_BEAM_VERSION"
  else
    flock -u 9
    die "the official job server is not available and --no-assemble was given"
  fi
  flock -u 9
  echo "$JAR"
}

do_path() {
  local jar
  if jar="$(pointer_jar)"; then echo "$jar"; return 0; fi
  echo "flink.sh: no Flink job server in $CACHE_DIR; run: infra/local/flink.sh fetch" >&2
  return 3
}

do_smoke() {
  local jar
  jar="$(do_fetch)"
  cd "$REPO"
  DORYLUS_FLINK_JOB_SERVER_JAR="$jar" "$PYTHON" - <<'EOF'
import logging, time
logging.disable(logging.WARNING)
import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that, equal_to
from pipelines.beam.runners import runner_options
t0 = time.time()
with beam.Pipeline(options=PipelineOptions(runner_options("flink", []))) as p:
    out = p | beam.Create(range(10)) | beam.Map(lambda x: (x % 3, x)) | beam.CombinePerKey(sum)
    assert_that(out, equal_to([(0, 18), (1, 12), (2, 15)]))
print(f"flink smoke ok: {time.time() - t0:.1f} s")
EOF
}

case "$cmd" in
  fetch) do_fetch ;;
  path) do_path ;;
  info) [[ -f "$POINTER" ]] && cat "$POINTER" || { echo "flink.sh: nothing fetched" >&2; exit 3; } ;;
  smoke) do_smoke ;;
  clean) rm -rf "$CACHE_DIR"; log "removed $CACHE_DIR" ;;
  *) die "unknown subcommand: $cmd (fetch|path|info|smoke|clean)" ;;
esac
