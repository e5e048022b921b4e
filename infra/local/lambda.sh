#!/usr/bin/env bash
# A local fleet of real Lambda runtimes: N AWS Lambda Runtime Interface Emulators, each running the Python runtime
# interface client (awslambdaric) with ops.lambda_handler.handler, as a container-image Lambda does.
#
#   infra/local/lambda.sh build                     # go install the emulator into the cache (no-op when cached)
#   infra/local/lambda.sh start --workers N         # start N emulators on 127.0.0.1, print one endpoint URL a line
#   infra/local/lambda.sh endpoints                 # the running fleet's endpoints, comma-separated
#                                                   #   (for dorylus train --tensor-workers aws --lambda-endpoint)
#   infra/local/lambda.sh status                    # "running N/M" and one line per emulator; exit 0 / 3 (stopped)
#   infra/local/lambda.sh stop                      # SIGTERM each emulator (it ends its runtime), wait, SIGKILL
#
# Each emulator is one Lambda instance: it serves one invocation at a time (a second one at once crashes it),
# and prints START/END/REPORT lines (Duration, Billed Duration, Memory Size) for every invocation to its log.
# The emulators inherit this environment: pass AWS_ENDPOINT_URL_S3, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY
# (and AWS_DEFAULT_REGION) so the handler reaches the same S3 endpoint as the driver.
#
# Options (any subcommand):
#   --state-dir DIR     fleet.json (the state file: endpoints, pids, logs), rie-K.log (default $DORYLUS_LAMBDA_STATE
#                       or <repo>/.cache/lambda-state)
#   --cache-dir DIR     where the built emulator lives (default $DORYLUS_CACHE/lambda-rie or <repo>/.cache/lambda-rie)
# start options:
#   --workers N         emulators (default 1)
#   --memory-mb M       the function's memory (AWS_LAMBDA_FUNCTION_MEMORY_SIZE; default 3008, as lambda_memory_mb)
#   --timeout S         the function's timeout in seconds (AWS_LAMBDA_FUNCTION_TIMEOUT; default 900)
#   --warm              invoke each emulator once with a probe event, so the runtimes' cold start is done
#   --owner-pid PID     stop the fleet when process PID exits (guards against leaked emulators)
#   --ready-timeout S   seconds to wait for every emulator's port (default 60)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-python3}"

RIE_MODULE="github.com/aws/aws-lambda-runtime-interface-emulator/cmd/aws-lambda-rie"
# v1.23.0 is not served by the module proxy; this pseudo-version is its commit
RIE_VERSION="${DORYLUS_RIE_VERSION:-v0.0.0-20261030222936-bef5c4ba774d}"
HANDLER="ops.lambda_handler.handler"
if [[ -n "${DORYLUS_CACHE:-}" ]]; then CACHE_DIR="$DORYLUS_CACHE/lambda-rie"; else CACHE_DIR="$REPO/.cache/lambda-rie"; fi
STATE_DIR="${DORYLUS_LAMBDA_STATE:-$REPO/.cache/lambda-state}"
WORKERS=1
MEMORY_MB=3008
FN_TIMEOUT=900
WARM=0
OWNER_PID=""
READY_TIMEOUT=60

die() { echo "lambda.sh: $*" >&2; exit 1; }
log() { echo "lambda.sh: $*" >&2; }

cmd="${1:-}"
[[ -n "$cmd" ]] || die "usage: lambda.sh build|start|endpoints|status|stop [options] (see the header of $0)"
shift
while [[ $# -gt 0 ]]; do
  case "$1" in
    --workers) WORKERS="$2"; shift 2 ;;
    --memory-mb) MEMORY_MB="$2"; shift 2 ;;
    --timeout) FN_TIMEOUT="$2"; shift 2 ;;
    --warm) WARM=1; shift ;;
    --owner-pid) OWNER_PID="$2"; shift 2 ;;
    --ready-timeout) READY_TIMEOUT="$2"; shift 2 ;;
    --state-dir) STATE_DIR="$2"; shift 2 ;;
    --cache-dir) CACHE_DIR="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;
    *) die "unknown option: $1" ;;
  esac
done

mkdir -p "$STATE_DIR"
STATE_DIR="$(cd "$STATE_DIR" && pwd)"
STATE="$STATE_DIR/fleet.json"
BIN_DIR="$CACHE_DIR/$RIE_VERSION"
RIE="$BIN_DIR/aws-lambda-rie"

# ----------------------------------------------------------------------------------------------------------- build
do_build() {
  if [[ -x "$RIE" ]]; then return 0; fi
  command -v go >/dev/null || die "go not found (the Go toolchain builds the emulator once: https://go.dev/dl)"
  mkdir -p "$BIN_DIR"
  # one build at a time (tests of several engineers may start together)
  exec 9>"$BIN_DIR/.build.lock"
  flock 9
  if [[ -x "$RIE" ]]; then flock -u 9; return 0; fi
  log "building the AWS Lambda Runtime Interface Emulator ($RIE_VERSION) into $BIN_DIR"
  rm -rf "$BIN_DIR/tmp"
  mkdir -p "$BIN_DIR/tmp"
  if ! (cd "$BIN_DIR/tmp" && GOBIN="$BIN_DIR/tmp" GOFLAGS=-buildvcs=false go install "$RIE_MODULE@$RIE_VERSION") \
        >"$BIN_DIR/build.log" 2>&1; then
    tail -n 30 "$BIN_DIR/build.log" >&2
    flock -u 9
    die "go install $RIE_MODULE@$RIE_VERSION failed (full log: $BIN_DIR/build.log)"
  fi
  mv "$BIN_DIR/tmp/aws-lambda-rie" "$RIE"
  rm -rf "$BIN_DIR/tmp"
  flock -u 9
}

# ----------------------------------------------------------------------------------------------------------- state
fleet_pids() {
  # "pid url" per emulator of the state file (empty when there is none)
  [[ -f "$STATE" ]] || return 0
  "$PYTHON" - "$STATE" <<'EOF'
import json, sys
for e in json.load(open(sys.argv[1]))["emulators"]:
    print(e["pid"], e["url"])
EOF
}

alive() {
  # the emulator pid runs and is an aws-lambda-rie
  kill -0 "$1" 2>/dev/null && grep -q 'aws-lambda-rie' "/proc/$1/cmdline" 2>/dev/null
}

# ----------------------------------------------------------------------------------------------------------- start
do_start() {
  [[ "$WORKERS" =~ ^[1-9][0-9]*$ ]] || die "--workers wants an integer >= 1, got '$WORKERS'"
  [[ "$MEMORY_MB" =~ ^[0-9]+$ ]] && (( MEMORY_MB >= 128 && MEMORY_MB <= 10240 )) \
    || die "--memory-mb wants an integer in [128, 10240] (Lambda's range), got '$MEMORY_MB'"
  [[ "$FN_TIMEOUT" =~ ^[1-9][0-9]*$ ]] || die "--timeout wants an integer number of seconds >= 1, got '$FN_TIMEOUT'"
  if [[ -f "$STATE" ]]; then
    local running=0 pid url
    while read -r pid url; do if alive "$pid"; then running=$((running + 1)); fi; done < <(fleet_pids)
    [[ "$running" -eq 0 ]] || die "a fleet runs already in $STATE_DIR ($running emulators): stop it first"
    rm -f "$STATE"
  fi
  do_build
  "$PYTHON" -c 'import awslambdaric' 2>/dev/null \
    || die "$PYTHON cannot import awslambdaric (pip install awslambdaric, or the test extra of dorylus)"
  local ports
  # 2 ports per emulator (invoke API, runtime API), all bound at once so they differ
  ports="$("$PYTHON" -c '
import socket, sys
ss = [socket.socket() for _ in range(2 * int(sys.argv[1]))]
for s in ss: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in ss))
for s in ss: s.close()' "$WORKERS")"
  read -r -a ports <<<"$ports"
  local k pids=() urls=() logs=()
  for ((k = 0; k < WORKERS; k++)); do
    local port="${ports[$((2 * k))]}" rport="${ports[$((2 * k + 1))]}" lf="$STATE_DIR/rie-$k.log"
    : >"$lf"
    # a session of its own (setsid: the subshell is no group leader, so its pid stays the emulator's); the
    # emulator starts the runtime (in a process group of its own) at the first invocation and ends it on SIGTERM
    (cd "$REPO" || exit 1
     PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" LOG_LEVEL="${LOG_LEVEL:-warn}" \
       AWS_LAMBDA_FUNCTION_NAME="${AWS_LAMBDA_FUNCTION_NAME:-dorylus-tensor}" \
       AWS_LAMBDA_FUNCTION_MEMORY_SIZE="$MEMORY_MB" AWS_LAMBDA_FUNCTION_TIMEOUT="$FN_TIMEOUT" \
       exec setsid "$RIE" --runtime-interface-emulator-address "127.0.0.1:$port" \
         --runtime-api-address "127.0.0.1:$rport" "$PYTHON" -m awslambdaric "$HANDLER" >>"$lf" 2>&1 </dev/null) &
    pids+=("$!")
    urls+=("http://127.0.0.1:$port")
    logs+=("$lf")
  done
  if ! "$PYTHON" - "$READY_TIMEOUT" "$WARM" "${pids[*]}" "${urls[*]}" <<'EOF'
import json, os, socket, sys, time, urllib.request
timeout, warm, pids, urls = float(sys.argv[1]), sys.argv[2] == "1", sys.argv[3].split(), sys.argv[4].split()
deadline = time.monotonic() + timeout
for pid, url in zip(pids, urls):
    host, port = url.rsplit("/", 1)[-1].split(":")
    while True:
        try:
            os.kill(int(pid), 0)
        except OSError:
            sys.exit(f"emulator {pid} ({url}) exited during startup")
        try:
            with socket.create_connection((host, int(port)), timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline:
                sys.exit(f"emulator {pid} ({url}) does not accept connections after {timeout}s")
            time.sleep(0.1)
if warm:  # a probe event the handler rejects at once: the runtime's init (imports) is what it costs
    for url in urls:
        req = urllib.request.Request(url + "/2015-03-31/functions/function/invocations",
                                     data=json.dumps({"probe": True}).encode(), method="POST")
        urllib.request.urlopen(req, timeout=max(deadline - time.monotonic(), 30)).read()
EOF
  then
    for pid in "${pids[@]}"; do
      for c in $(descendants "$pid"); do kill -KILL "$c" 2>/dev/null || true; done
      kill -KILL "$pid" 2>/dev/null || true
    done
    die "the fleet did not start (logs: $STATE_DIR/rie-*.log)"
  fi
  "$PYTHON" - "$STATE" "$MEMORY_MB" "$FN_TIMEOUT" "$RIE" "${pids[*]}" "${urls[*]}" "${logs[*]}" <<'EOF'
import json, os, sys, time
path, mem, timeout, rie = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
pids, urls, logs = (a.split() for a in sys.argv[5:8])
doc = {"endpoints": urls, "memory_mb": mem, "timeout_s": timeout, "emulator": rie,
       "s3_endpoint": os.environ.get("AWS_ENDPOINT_URL_S3"), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
       "emulators": [{"url": u, "pid": int(p), "log": l} for p, u, l in zip(pids, urls, logs)]}
with open(path + ".tmp", "w") as f:
    json.dump(doc, f, indent=2)
    f.write("\n")
os.replace(path + ".tmp", path)
EOF
  if [[ -n "$OWNER_PID" ]]; then
    # watchdog: when the owner goes away without calling stop, stop the fleet
    setsid nohup bash -c '
      owner=$1; shift
      while kill -0 "$owner" 2>/dev/null; do sleep 2; done
      "$@" >/dev/null 2>&1' _ "$OWNER_PID" bash "$HERE/lambda.sh" stop --state-dir "$STATE_DIR" \
      >/dev/null 2>&1 </dev/null &
    echo $! >"$STATE_DIR/watchdog.pid"
  fi
  printf '%s\n' "${urls[@]}"
}

# ------------------------------------------------------------------------------------------------------ stop/status
descendants() {
  local c
  for c in $(ps -o pid= --ppid "$1" 2>/dev/null); do echo "$c"; descendants "$c"; done
}

do_stop() {
  local pid url left
  local -a all=() kids=()
  while read -r pid url; do
    alive "$pid" || continue
    all+=("$pid")
    kids+=($(descendants "$pid"))
    kill -TERM "$pid" 2>/dev/null || true
  done < <(fleet_pids)
  for _ in $(seq 1 50); do
    left=0
    for pid in "${all[@]}" "${kids[@]}"; do if kill -0 "$pid" 2>/dev/null; then left=1; fi; done
    [[ "$left" -eq 0 ]] && break
    sleep 0.2
  done
  for pid in "${all[@]}" "${kids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  rm -f "$STATE"
  if [[ -f "$STATE_DIR/watchdog.pid" ]]; then
    pid="$(cat "$STATE_DIR/watchdog.pid")"
    rm -f "$STATE_DIR/watchdog.pid"
    [[ "$pid" == "${PPID:-}" ]] || kill "$pid" 2>/dev/null || true
  fi
}

do_status() {
  [[ -f "$STATE" ]] || { echo "stopped"; exit 3; }
  local pid url n=0 up=0 lines=()
  while read -r pid url; do
    n=$((n + 1))
    if alive "$pid"; then up=$((up + 1)); lines+=("$url running (pid $pid)"); else lines+=("$url dead (pid $pid)"); fi
  done < <(fleet_pids)
  echo "running $up/$n"
  printf '%s\n' "${lines[@]}"
  [[ "$up" -gt 0 ]] || exit 3
}

do_endpoints() {
  [[ -f "$STATE" ]] || die "no fleet in $STATE_DIR (lambda.sh start --workers N)"
  "$PYTHON" -c 'import json, sys; print(",".join(json.load(open(sys.argv[1]))["endpoints"]))' "$STATE"
}

case "$cmd" in
  build) do_build; echo "$RIE" ;;
  start) do_start ;;
  stop) do_stop ;;
  status) do_status ;;
  endpoints) do_endpoints ;;
  *) die "unknown command: $cmd (build|start|endpoints|status|stop)" ;;
esac
