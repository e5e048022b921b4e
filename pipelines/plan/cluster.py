"""Where the simulated roles run: machines (cores, relative speed), links (bandwidth, latency), Lambda defaults.

Two layouts. `local`: this machine, every role a thread of one process sharing its cores, messages passed in
memory (the calibration target). `aws`: one EC2 instance per graph server and one for the parameter server,
tensor tasks on Lambdas (each its own small machine behind a ~200 Mbit/s link) or, for `cpu-only`, on one
executor thread per graph server that shares the graph server's instance.

Instance figures are public ones (vCPUs, baseline network bandwidth); `speed` is a core's speed relative to a
c5 core (Xeon Platinum 8000 at 3.0-3.5 GHz); the calibration machine's own core speed relative to c5 is
`Network.local_speed` (default 1.0: an assumption, see docs/plan.md).
"""
from __future__ import annotations

import dataclasses

from pipelines.config import ConfigError
from schemas.tasks import StalenessMode

MBIT = 1e6 / 8
GBIT = 1e9 / 8


@dataclasses.dataclass(frozen=True)
class Instance:
    vcpus: int
    network_bytes_s: float   # sustained (baseline) bandwidth, not the "up to" burst figure
    speed: float = 1.0       # one core relative to a c5 core
    gpu: bool = False


#: EC2 types of the price table. Baseline bandwidths: AWS's published per-instance baseline figures.
INSTANCES = {
    "c5.xlarge": Instance(4, 1.25 * GBIT),
    "c5.2xlarge": Instance(8, 2.5 * GBIT),
    "c5.4xlarge": Instance(16, 5.0 * GBIT),
    "c5n.xlarge": Instance(4, 5.0 * GBIT),
    "c5n.2xlarge": Instance(8, 10.0 * GBIT),
    "c5n.4xlarge": Instance(16, 15.0 * GBIT),
    "c5n.9xlarge": Instance(36, 50.0 * GBIT),
    "p3.2xlarge": Instance(8, 2.5 * GBIT, gpu=True),
}


@dataclasses.dataclass(frozen=True)
class LambdaSpec:
    """AWS Lambda's public figures: one vCPU per 1769 MB (up to 6), ~200 Mbit/s to EC2 in a VPC, an invoke round
    trip of tens of milliseconds, and a cold start once per new execution environment."""

    memory_mb: int = 3008
    bandwidth_bytes_s: float = 200 * MBIT
    rtt_s: float = 0.02
    cold_start_s: float = 0.6
    speed: float = 0.9       # a Lambda vCPU relative to a c5 core (Lambda runs on older/shared hosts)

    @property
    def vcpus(self) -> float:
        return min(6.0, max(self.memory_mb / 1769.0, 0.07))


@dataclasses.dataclass(frozen=True)
class Network:
    """Latency of one message between roles (Kafka on MSK across instances; in memory locally)."""

    kafka_latency_s: float = 0.003
    local_latency_s: float = 0.0002
    local_speed: float = 1.0          # this machine's core relative to a c5 core
    dense_efficiency: float = 0.6     # how much of each extra core a dense task (matrix product) turns into speed


@dataclasses.dataclass(frozen=True)
class Layout:
    """One simulated deployment.

    kind: "local" (one machine of `cores` cores), "aws" (instances and Lambdas or inline executors).
    workers: tensor-worker concurrency (local pool size, or Lambdas in flight over all graph servers); ignored
    for `inline` (cpu-only: one executor per graph server)."""

    kind: str
    partitions: int
    workers: int
    backend: str = "pool"                 # "pool" (local threads), "lambda", or "inline" (cpu-only)
    staleness: int | None = 0
    staleness_mode: StalenessMode = StalenessMode.PREDICT   # what S >= 1 makes stale (the engine's modes)
    sync_warmup: int = 0                  # epochs run at S = 0 first (a plan's candidates model the steady state)
    cores: float = 2.0                    # local: the machine's cores
    background: float = 0.0               # local: other runnable threads sharing them (the machine's load)
    task_latency_s: float = 0.0           # local: --task-latency-s
    graph_instance: str = "c5n.2xlarge"
    ps_instance: str = "c5.xlarge"
    lam: LambdaSpec = LambdaSpec()
    net: Network = Network()
    straggler_k: float = 2.0
    straggler_min_s: float = 0.5

    def instance(self, name: str) -> Instance:
        if name not in INSTANCES:
            raise ConfigError(f"instance type {name!r} has no hardware figures in the plan (known: "
                              f"{', '.join(sorted(INSTANCES))})")
        inst = INSTANCES[name]
        if inst.gpu:
            raise ConfigError(f"instance type {name!r} is a GPU instance; the plan models CPU graph servers only")
        return inst
