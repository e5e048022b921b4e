#!/usr/bin/env bash
# A real, single-node Apache Kafka broker (KRaft, combined broker+controller) for tests and demos.
#
#   infra/local/kafka.sh fetch                      # jars from Maven Central into the cache (no-op when cached)
#   infra/local/kafka.sh start [--port N]           # format + start on 127.0.0.1, print 127.0.0.1:PORT when ready
#   infra/local/kafka.sh start --scram USER:PASS    # the same, MSK-like: SASL_SSL + SCRAM-SHA-512 on that port
#   infra/local/kafka.sh stop [--keep-data]         # SIGTERM, wait, SIGKILL; removes the data dir unless --keep-data
#   infra/local/kafka.sh restart                    # stop --keep-data, then start on the same ports and mode (data kept)
#   infra/local/kafka.sh status                     # "running 127.0.0.1:PORT (pid N)" / "stopped"; exit 0 / 3
#
# A replicated cluster (N KRaft nodes on 127.0.0.1, each a combined broker+controller, an N-voter quorum):
#   infra/local/kafka.sh start --brokers 3          # prints the bootstrap list 127.0.0.1:P1,127.0.0.1:P2,...
#   infra/local/kafka.sh start --brokers 3 --listener NAME=A1,A2,A3   # and a client listener NAME per node,
#                                                   # advertised at 127.0.0.1:A<i> (a fault proxy's ports)
#   infra/local/kafka.sh kill --node I              # SIGKILL node I (a crash; its data stays)
#   infra/local/kafka.sh start --node I             # start node I of the cluster again (same ports and data)
#   stop / restart / status act on every node; status prints one line per node, exit 0 when all run
#
# Common options (any subcommand):
#   --state-dir DIR     where server.properties, data/, kafka.log, kafka.pid, bootstrap (and, with --scram, tls/,
#                       client.json, scram) live
#                       (default $DORYLUS_KAFKA_STATE or <repo>/.cache/kafka-state)
#   --cache-dir DIR     jar cache (default $DORYLUS_CACHE/kafka or <repo>/.cache/kafka)
#   --version V         Kafka version (default $DORYLUS_KAFKA_VERSION or 4.1.2)
# start options:
#   --port N            client port (default: the port of the previous run in this state dir if free, else a free one)
#   --controller-port N KRaft controller port (default: likewise)
#   --max-message-bytes N   message.max.bytes (default 67108864 = 64 MiB)
#   --timeout S         seconds to wait until the broker answers a metadata request (default 120)
#   --owner-pid PID     stop the broker when process PID exits (guards against leaked brokers)
#   --heap SIZE         JVM max heap (default 1g)
#   --scram USER:PASSWORD   behave like Amazon MSK with SASL/SCRAM: the client port is SASL_SSL, mechanism
#                       SCRAM-SHA-512, user USER created at storage format time; TLS with a self-signed certificate
#                       for CN=localhost, SAN IP:127.0.0.1,DNS:localhost, made once per state dir with keytool
#                       (tls/broker.p12, its password in tls/password, the certificate as PEM in tls/ca.pem for
#                       the clients' CA file). Inter-broker traffic uses a second, PLAINTEXT port on 127.0.0.1,
#                       the controller stays PLAINTEXT. Also writes <state-dir>/client.json (mode 600):
#                       {"bootstrap", "security_protocol", "sasl_mechanism", "username", "password", "cafile"}.
#                       USER and PASSWORD: letters, digits and . _ ~ + / @ % ! # ^ * - only. restart keeps the mode;
#                       start without --scram is the plain PLAINTEXT broker. A data dir formatted without these
#                       credentials is refused (stop without --keep-data first).
#   --brokers N         nodes of a cluster (default 1: the single broker above). Node i (1..N) lives in
#                       <state-dir>/node-<i>/ (server.properties, data/, kafka.log, kafka.pid, ports); its client
#                       port (PLAINTEXT, the bootstrap list), inter-broker port (INTERNAL) and controller port
#                       are free ports, kept for restarts. Internal topics get replication factor min(N, 3).
#                       <state-dir>/listeners has one line per node and listener: NAME NODE PORT ADVERTISED_PORT
#   --listener NAME=A1,...,AN   (cluster mode, repeatable) an extra PLAINTEXT client listener NAME on a free
#                       port of each node, advertised at 127.0.0.1:A<i>: clients that bootstrap there talk to the
#                       brokers only through whatever listens on the A ports (infra: a fault proxy)
#   --node I            start: only node I of an existing cluster; kill: the node to SIGKILL
# stop options:
#   --timeout S         seconds to wait after SIGTERM before SIGKILL (default 30)
#   --keep-data         keep the data dir (committed data survives the next start)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-python3}"

KAFKA_VERSION="${DORYLUS_KAFKA_VERSION:-4.1.2}"
LOG4J_VERSION="2.24.3"
DEP_PLUGIN_VERSION="3.8.1"
if [[ -n "${DORYLUS_CACHE:-}" ]]; then CACHE_DIR="$DORYLUS_CACHE/kafka"; else CACHE_DIR="$REPO/.cache/kafka"; fi
STATE_DIR="${DORYLUS_KAFKA_STATE:-$REPO/.cache/kafka-state}"
PORT=""
CPORT=""
MAX_MESSAGE_BYTES=67108864
TIMEOUT=""
OWNER_PID=""
HEAP="1g"
KEEP_DATA=0
BROKERS=""      # nodes of a cluster (empty: the single broker, or the cluster the state dir holds)
NODE=""         # start/kill: one node of a cluster
LISTENERS=()    # extra client listeners NAME=A1,...,AN (cluster mode)
SCRAM=""        # USER:PASSWORD in MSK-like SASL_SSL/SCRAM mode, empty in plain mode
IPORT=""        # inter-broker PLAINTEXT port (SCRAM mode only)

die() { echo "kafka.sh: $*" >&2; exit 1; }
log() { echo "kafka.sh: $*" >&2; }

cmd="${1:-}"
[[ -n "$cmd" ]] || die "usage: kafka.sh fetch|start|stop|restart|status [options] (see the header of $0)"
shift
while [[ $# -gt 0 ]]; do
  case "$1" in
    --port) PORT="$2"; shift 2 ;;
    --controller-port) CPORT="$2"; shift 2 ;;
    --state-dir) STATE_DIR="$2"; shift 2 ;;
    --cache-dir) CACHE_DIR="$2"; shift 2 ;;
    --version) KAFKA_VERSION="$2"; shift 2 ;;
    --max-message-bytes) MAX_MESSAGE_BYTES="$2"; shift 2 ;;
    --timeout) TIMEOUT="$2"; shift 2 ;;
    --owner-pid) OWNER_PID="$2"; shift 2 ;;
    --heap) HEAP="$2"; shift 2 ;;
    --keep-data) KEEP_DATA=1; shift ;;
    --scram) SCRAM="$2"; shift 2 ;;
    --brokers) BROKERS="$2"; shift 2 ;;
    --node) NODE="$2"; shift 2 ;;
    --listener) LISTENERS+=("$2"); shift 2 ;;
    -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;
    *) die "unknown option: $1" ;;
  esac
done

mkdir -p "$STATE_DIR"
STATE_DIR="$(cd "$STATE_DIR" && pwd)"
VDIR="$CACHE_DIR/$KAFKA_VERSION"
JARS="$VDIR/jars"
PID_FILE="$STATE_DIR/kafka.pid"
LOG_FILE="$STATE_DIR/kafka.log"
PROPS="$STATE_DIR/server.properties"
DATA_DIR="$STATE_DIR/data"
BOOT_FILE="$STATE_DIR/bootstrap"
PORTS_FILE="$STATE_DIR/ports"
WATCH_PID_FILE="$STATE_DIR/watchdog.pid"
SCRAM_FILE="$STATE_DIR/scram"            # the mode of the last start: USER:PASSWORD (SCRAM mode), absent (plain)
DATA_SCRAM_FILE="$STATE_DIR/data.scram"  # sha256 of the USER:PASSWORD the data dir was formatted with
CLIENT_FILE="$STATE_DIR/client.json"
TLS_DIR="$STATE_DIR/tls"

# ----------------------------------------------------------------------------------------------------------- fetch
do_fetch() {
  if [[ -f "$JARS/.complete" ]]; then return 0; fi
  command -v mvn >/dev/null || die "mvn not found (needed once to fetch the Kafka jars)"
  mkdir -p "$VDIR"
  # one fetch at a time per version (tests of several engineers may start together)
  exec 9>"$VDIR/.fetch.lock"
  flock 9
  if [[ -f "$JARS/.complete" ]]; then flock -u 9; return 0; fi
  log "fetching Apache Kafka $KAFKA_VERSION jars from Maven Central into $JARS"
  cat >"$VDIR/pom.xml" <<EOF
<?xml version="1.0" encoding="UTF-8"?>
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>dorylus.local</groupId>
  <artifactId>kafka-broker-jars</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_2.13</artifactId><version>$KAFKA_VERSION</version></dependency>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka-server</artifactId><version>$KAFKA_VERSION</version></dependency>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka-metadata</artifactId><version>$KAFKA_VERSION</version></dependency>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka-raft</artifactId><version>$KAFKA_VERSION</version></dependency>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka-storage</artifactId><version>$KAFKA_VERSION</version></dependency>
    <!-- logging: slf4j 1.7 -> log4j2, configured by infra/local/log4j2.properties -->
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j-impl</artifactId><version>$LOG4J_VERSION</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-core</artifactId><version>$LOG4J_VERSION</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-api</artifactId><version>$LOG4J_VERSION</version></dependency>
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
  rm -rf "$JARS.tmp"
  if ! mvn -q -B -f "$VDIR/pom.xml" dependency:copy-dependencies \
        -DoutputDirectory="$JARS.tmp" -DincludeScope=runtime -DexcludeArtifactIds=slf4j-reload4j,reload4j,log4j \
        >"$VDIR/mvn.log" 2>&1; then
    tail -n 40 "$VDIR/mvn.log" >&2
    flock -u 9
    die "mvn dependency:copy-dependencies failed (full log: $VDIR/mvn.log)"
  fi
  ls "$JARS.tmp"/kafka_2.13-"$KAFKA_VERSION".jar >/dev/null 2>&1 || { flock -u 9; die "kafka_2.13 jar missing after fetch"; }
  rm -rf "$JARS"
  mv "$JARS.tmp" "$JARS"
  date -u +%FT%TZ >"$JARS/.complete"
  log "fetched $(ls "$JARS"/*.jar | wc -l) jars ($(du -sh "$JARS" | cut -f1))"
  flock -u 9
}

# --------------------------------------------------------------------------------------------------------- helpers
running_pid() {
  # prints the broker pid when it runs, else nothing
  [[ -f "$PID_FILE" ]] || return 0
  local pid
  pid="$(cat "$PID_FILE" 2>/dev/null || true)"
  [[ -n "$pid" ]] || return 0
  if kill -0 "$pid" 2>/dev/null && grep -q 'kafka.Kafka' "/proc/$pid/cmdline" 2>/dev/null; then echo "$pid"; fi
}

free_port() {
  "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

port_free() {
  "$PYTHON" - "$1" <<'EOF'
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(1)
finally:
    s.close()
EOF
}

java_cmd() {
  # java with the cached jars on the class path and the quiet log4j2 config (short-lived tools: C1 only)
  java -Xms128m -Xmx"$HEAP" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:+ExitOnOutOfMemoryError -XX:TieredStopAtLevel=1 \
    -Djava.awt.headless=true -Dkafka.logs.dir="$STATE_DIR" \
    -Dlog4j2.configurationFile="$HERE/log4j2.properties" -Dlog4j.configurationFile="$HERE/log4j2.properties" \
    -cp "$JARS/*" "$@"
}

wait_ready() {
  # a kafka-python metadata call must succeed (bounded by a timeout); fails fast when the JVM dies.
  # In SCRAM mode it goes through the client port with SASL_SSL/SCRAM-SHA-512 and the broker's certificate.
  local pid="$1" timeout="$2"
  DORYLUS_READY_SCRAM="$SCRAM" DORYLUS_READY_CAFILE="$TLS_DIR/ca.pem" \
  "$PYTHON" - "127.0.0.1:$PORT" "$pid" "$timeout" <<'EOF'
import os, socket, sys, time
boot, pid, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + timeout
host, port = boot.rsplit(":", 1)
security = {}
if os.environ.get("DORYLUS_READY_SCRAM"):
    user, password = os.environ["DORYLUS_READY_SCRAM"].split(":", 1)
    security = dict(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_plain_username=user,
                    sasl_plain_password=password, ssl_cafile=os.environ["DORYLUS_READY_CAFILE"])

def alive():
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False

try:
    from kafka import KafkaAdminClient
except ImportError:  # kafka-python absent: fall back to "the port accepts connections"
    KafkaAdminClient = None
last = None
while time.monotonic() < deadline:
    if not alive():
        print(f"broker process {pid} exited during startup", file=sys.stderr)
        sys.exit(2)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            pass
        if KafkaAdminClient is None:
            sys.exit(0)
        admin = KafkaAdminClient(bootstrap_servers=boot, request_timeout_ms=5000, client_id="dorylus-readiness",
                                 **security)
        try:
            info = admin.describe_cluster()
            if info.get("brokers"):
                admin.list_topics()
                sys.exit(0)
        finally:
            admin.close()
    except Exception as e:  # noqa: BLE001 - not ready yet
        last = e
    time.sleep(0.25)
print(f"broker not ready after {timeout}s: {last!r}", file=sys.stderr)
sys.exit(1)
EOF
}

sizes_and_threads() {
  # the broker settings every node shares: message sizes, and few threads (small machine); $1 io threads
  cat <<EOF
# big Arrow batches (one message per interval): 64 MiB by default
message.max.bytes=$MAX_MESSAGE_BYTES
replica.fetch.max.bytes=$MAX_MESSAGE_BYTES
fetch.max.bytes=$(( MAX_MESSAGE_BYTES * 2 ))
socket.request.max.bytes=$(( MAX_MESSAGE_BYTES * 2 + 1048576 ))
num.network.threads=2
num.io.threads=$1
background.threads=2
num.recovery.threads.per.data.dir=1
log.cleaner.threads=1
log.retention.hours=24
EOF
}

write_props() {
  local listeners advertised inter protocols
  if [[ -n "$SCRAM" ]]; then
    # MSK-like: clients on SASL_SSL (SCRAM-SHA-512), inter-broker on its own PLAINTEXT port
    listeners="SASL_SSL://127.0.0.1:$PORT,INTERNAL://127.0.0.1:$IPORT,CONTROLLER://127.0.0.1:$CPORT"
    advertised="SASL_SSL://127.0.0.1:$PORT,INTERNAL://127.0.0.1:$IPORT"
    inter="INTERNAL"
    protocols="CONTROLLER:PLAINTEXT,INTERNAL:PLAINTEXT,SASL_SSL:SASL_SSL"
  else
    listeners="PLAINTEXT://127.0.0.1:$PORT,CONTROLLER://127.0.0.1:$CPORT"
    advertised="PLAINTEXT://127.0.0.1:$PORT"
    inter="PLAINTEXT"
    protocols="CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT"
  fi
  rm -f "$PROPS"
  if [[ -n "$SCRAM" ]]; then (umask 077; : >"$PROPS"); fi  # it holds the keystore password
  cat >"$PROPS" <<EOF
# generated by infra/local/kafka.sh
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$CPORT
listeners=$listeners
advertised.listeners=$advertised
controller.listener.names=CONTROLLER
inter.broker.listener.name=$inter
listener.security.protocol.map=$protocols
log.dirs=$DATA_DIR
num.partitions=1
default.replication.factor=1
auto.create.topics.enable=false
delete.topic.enable=true
offsets.topic.replication.factor=1
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
$(sizes_and_threads 4)
EOF
  if [[ -n "$SCRAM" ]]; then
    local ks_pass
    ks_pass="$(cat "$TLS_DIR/password")"
    cat >>"$PROPS" <<EOF
# MSK-like SASL/SCRAM: users come from the metadata log (created at format time), TLS from tls/broker.p12
sasl.enabled.mechanisms=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
ssl.keystore.type=PKCS12
ssl.keystore.location=$TLS_DIR/broker.p12
ssl.keystore.password=$ks_pass
ssl.key.password=$ks_pass
EOF
  fi
}

ensure_tls() {
  # once per state dir: a self-signed RSA key + certificate for CN=localhost (SAN IP:127.0.0.1,DNS:localhost)
  # in a PKCS12 keystore with a random password; the certificate as PEM is the clients' CA file
  local ks="$TLS_DIR/broker.p12" pass_file="$TLS_DIR/password" ca="$TLS_DIR/ca.pem"
  if [[ -s "$ks" && -s "$pass_file" && -s "$ca" ]]; then return 0; fi
  command -v keytool >/dev/null || die "keytool not found (part of Java 17+; needed for --scram)"
  local tmp="$TLS_DIR.tmp" pass
  rm -rf "$tmp"
  mkdir -p "$tmp"
  pass="$("$PYTHON" -c 'import secrets; print(secrets.token_hex(24))')"
  (umask 077; printf '%s' "$pass" >"$tmp/password")
  # passwords through the environment (:env), not the command line
  if ! DORYLUS_KS_PASS="$pass" keytool -genkeypair -noprompt -alias broker -keyalg RSA -keysize 2048 \
        -validity 3650 -dname "CN=localhost" -ext "SAN=IP:127.0.0.1,DNS:localhost" \
        -storetype PKCS12 -keystore "$tmp/broker.p12" \
        -storepass:env DORYLUS_KS_PASS -keypass:env DORYLUS_KS_PASS >"$tmp/keytool.log" 2>&1 \
     || ! DORYLUS_KS_PASS="$pass" keytool -exportcert -rfc -alias broker -storetype PKCS12 \
        -keystore "$tmp/broker.p12" -storepass:env DORYLUS_KS_PASS -file "$tmp/ca.pem" >>"$tmp/keytool.log" 2>&1
  then
    cat "$tmp/keytool.log" >&2
    die "keytool failed to make the broker's TLS keystore (in $tmp)"
  fi
  chmod 600 "$tmp/broker.p12" "$tmp/password"
  chmod 644 "$tmp/ca.pem"
  rm -f "$tmp/keytool.log"
  rm -rf "$TLS_DIR"
  mv "$tmp" "$TLS_DIR"
  log "made a self-signed TLS certificate for CN=localhost in $TLS_DIR"
}

write_client_json() {
  # what a client needs for the SASL_SSL/SCRAM listener (mode 600: it holds the password)
  DORYLUS_CLIENT_SCRAM="$SCRAM" "$PYTHON" - "$CLIENT_FILE" "127.0.0.1:$PORT" "$TLS_DIR/ca.pem" <<'EOF'
import json, os, sys
path, boot, cafile = sys.argv[1:4]
user, password = os.environ["DORYLUS_CLIENT_SCRAM"].split(":", 1)
doc = {"bootstrap": boot, "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
       "username": user, "password": password, "cafile": os.path.abspath(cafile)}
tmp = path + ".tmp"
fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
with os.fdopen(fd, "w") as f:
    json.dump(doc, f, indent=2)
    f.write("\n")
os.chmod(tmp, 0o600)
os.replace(tmp, path)
EOF
}

scram_digest() {
  printf '%s' "$SCRAM" | sha256sum | cut -d' ' -f1
}

# ----------------------------------------------------------------------------------------------------------- start
do_start() {
  local pid
  pid="$(running_pid)"
  if [[ -n "$pid" ]]; then
    cat "$BOOT_FILE"
    return 0
  fi
  if [[ -n "$SCRAM" ]]; then
    [[ "$SCRAM" == *:* ]] || die "--scram wants USER:PASSWORD"
    local user="${SCRAM%%:*}" pass="${SCRAM#*:}"
    [[ -n "$user" && -n "$pass" ]] || die "--scram wants a non-empty USER and PASSWORD"
    # the StorageTool's --add-scram syntax (name=...,password=...) has no escaping: a safe alphabet only
    [[ "$user$pass" =~ ^[A-Za-z0-9._~+/@%!#^*-]+$ ]] \
      || die "--scram: USER and PASSWORD may hold letters, digits and . _ ~ + / @ % ! # ^ * - only"
  fi
  do_fetch
  command -v java >/dev/null || die "java not found (Java 17+ needed)"
  # ports: explicit > previous run in this state dir (if free) > a free one
  local prev_port="" prev_cport="" prev_iport=""
  if [[ -f "$PORTS_FILE" ]]; then read -r prev_port prev_cport prev_iport <"$PORTS_FILE" || true; fi
  if [[ -z "$PORT" ]]; then
    if [[ -n "$prev_port" ]] && port_free "$prev_port"; then PORT="$prev_port"; else PORT="$(free_port)"; fi
  fi
  if [[ -z "$CPORT" ]]; then
    if [[ -n "$prev_cport" && "$prev_cport" != "$PORT" ]] && port_free "$prev_cport"; then CPORT="$prev_cport"
    else
      CPORT="$(free_port)"
      while [[ "$CPORT" == "$PORT" ]]; do CPORT="$(free_port)"; done
    fi
  fi
  port_free "$PORT" || die "port $PORT is in use"
  rm -f "$BOOT_FILE" "$CLIENT_FILE"
  if [[ -n "$SCRAM" ]]; then
    # SCRAM users live in the metadata log: a kept data dir must have been formatted with these credentials
    if [[ -f "$DATA_DIR/meta.properties" && "$(cat "$DATA_SCRAM_FILE" 2>/dev/null || true)" != "$(scram_digest)" ]]; then
      die "the data dir $DATA_DIR was formatted without these SCRAM credentials; run 'kafka.sh stop' (without --keep-data) first"
    fi
    # the inter-broker PLAINTEXT port: previous run's if free, else a free one (never the client/controller port)
    if [[ -n "$prev_iport" && "$prev_iport" != "$PORT" && "$prev_iport" != "$CPORT" ]] && port_free "$prev_iport"; then
      IPORT="$prev_iport"
    else
      IPORT="$(free_port)"
      while [[ "$IPORT" == "$PORT" || "$IPORT" == "$CPORT" ]]; do IPORT="$(free_port)"; done
    fi
    echo "$PORT $CPORT $IPORT" >"$PORTS_FILE"
    # the mode, for restart (mode 600: it holds the password)
    (umask 077; printf '%s\n' "$SCRAM" >"$SCRAM_FILE.tmp")
    mv "$SCRAM_FILE.tmp" "$SCRAM_FILE"
    ensure_tls
  else
    echo "$PORT $CPORT" >"$PORTS_FILE"
    rm -f "$SCRAM_FILE"
  fi
  write_props

  # format KRaft storage once per data dir (a kept data dir is reused: committed data survives a restart)
  if [[ ! -f "$DATA_DIR/meta.properties" ]]; then
    rm -rf "$DATA_DIR"
    rm -f "$DATA_SCRAM_FILE"
    local cluster_id
    local -a scram_args=()
    if [[ -n "$SCRAM" ]]; then
      scram_args=(--add-scram "SCRAM-SHA-512=[name=${SCRAM%%:*},password=${SCRAM#*:}]")
    fi
    cluster_id="$("$PYTHON" -c 'import base64, uuid
# as Kafka'"'"'s own Uuid.randomUuid: an id that starts with "-" reads as an option to kafka-storage
while (i := base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")).startswith("-"): pass
print(i)')"
    if ! java_cmd kafka.tools.StorageTool format -t "$cluster_id" -c "$PROPS" --ignore-formatted \
          ${scram_args[@]+"${scram_args[@]}"} >>"$LOG_FILE" 2>&1; then
      tail -n 30 "$LOG_FILE" >&2
      die "kafka-storage format failed (log: $LOG_FILE)"
    fi
    if [[ -n "$SCRAM" ]]; then scram_digest >"$DATA_SCRAM_FILE"; fi
  fi

  echo "=== start $(date -u +%FT%TZ) port=$PORT controller=$CPORT${SCRAM:+ internal=$IPORT mode=SASL_SSL/SCRAM-SHA-512}" >>"$LOG_FILE"
  setsid nohup bash -c 'exec "$@"' _ java -Xms128m -Xmx"$HEAP" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
    -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true -Dkafka.logs.dir="$STATE_DIR" \
    -Dlog4j2.configurationFile="$HERE/log4j2.properties" \
    -cp "$JARS/*" kafka.Kafka "$PROPS" >>"$LOG_FILE" 2>&1 </dev/null &
  pid=$!
  echo "$pid" >"$PID_FILE"

  if [[ -n "$OWNER_PID" ]]; then
    # watchdog: when the owner goes away without calling stop, stop the broker (SIGTERM, then SIGKILL)
    setsid nohup bash -c '
      owner=$1; pid=$2
      while kill -0 "$owner" 2>/dev/null && kill -0 "$pid" 2>/dev/null; do sleep 2; done
      if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null
        for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || exit 0; sleep 0.5; done
        kill -KILL "$pid" 2>/dev/null
      fi' _ "$OWNER_PID" "$pid" >/dev/null 2>&1 </dev/null &
    echo $! >"$WATCH_PID_FILE"
  fi

  if ! wait_ready "$pid" "${TIMEOUT:-120}"; then
    log "broker did not become ready; last log lines:"
    tail -n 40 "$LOG_FILE" >&2
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$PID_FILE"
    exit 1
  fi
  if [[ -n "$SCRAM" ]]; then write_client_json; fi
  echo "127.0.0.1:$PORT" >"$BOOT_FILE"
  echo "127.0.0.1:$PORT"
}

# ------------------------------------------------------------------------------------------------------------ stop
do_stop() {
  local pid timeout="${TIMEOUT:-30}"
  pid="$(running_pid)"
  if [[ -f "$WATCH_PID_FILE" ]]; then
    local w
    w="$(cat "$WATCH_PID_FILE" 2>/dev/null || true)"
    if [[ -n "$w" ]] && kill -0 "$w" 2>/dev/null; then kill -TERM "$w" 2>/dev/null || true; fi
    rm -f "$WATCH_PID_FILE"
  fi
  if [[ -n "$pid" ]]; then
    stop_pid "$pid" "$timeout"   # kafka_cluster.sh: SIGTERM, wait, then SIGKILL
    echo "=== stopped $(date -u +%FT%TZ)" >>"$LOG_FILE"
    echo "stopped (pid $pid)"
  else
    echo "not running"
  fi
  rm -f "$PID_FILE" "$BOOT_FILE" "$CLIENT_FILE"
  if [[ "$KEEP_DATA" != 1 ]]; then rm -rf "$DATA_DIR"; rm -f "$DATA_SCRAM_FILE"; fi
}

do_status() {
  local pid
  pid="$(running_pid)"
  if [[ -n "$pid" ]]; then
    echo "running $(cat "$BOOT_FILE" 2>/dev/null || echo starting) (pid $pid)$([[ -f "$SCRAM_FILE" ]] && echo " SASL_SSL/SCRAM-SHA-512")"
    return 0
  fi
  echo "stopped"
  return 3
}

# ---------------------------------------------------------------------------------------------------- cluster
source "$HERE/kafka_cluster.sh"
CLUSTER_FILE="$STATE_DIR/cluster"        # N, while the state dir holds a cluster
if [[ -n "$BROKERS" ]]; then
  [[ "$BROKERS" =~ ^[1-9][0-9]?$ ]] || die "--brokers wants a number of nodes 1..99, got '$BROKERS'"
fi
if [[ "$cmd" != fetch ]] && { [[ -f "$CLUSTER_FILE" ]] || [[ "${BROKERS:-1}" -gt 1 ]] || [[ ${#LISTENERS[@]} -gt 0 ]]; }; then
  [[ -z "$SCRAM" ]] || die "--scram is a single-broker mode (no --brokers/--listener)"
  cluster_main "$cmd"
  exit $?
fi
[[ -z "$NODE" ]] || die "--node names a node of a cluster (start --brokers N first)"
[[ "$cmd" != kill ]] || die "kill --node I acts on a cluster (start --brokers N first)"

case "$cmd" in
  fetch) do_fetch; echo "$JARS" ;;
  start) do_start ;;
  stop) do_stop ;;
  restart)
    KEEP_DATA=1 do_stop >/dev/null
    # the mode of the previous start (SCRAM credentials), unless given again
    if [[ -z "$SCRAM" && -f "$SCRAM_FILE" ]]; then SCRAM="$(cat "$SCRAM_FILE")"; fi
    do_start ;;
  status) do_status ;;
  *) die "unknown subcommand: $cmd (fetch|start|stop|restart|status)" ;;
esac
