"""Bench: billed GB-seconds of a run over real Lambda runtimes (the emulators' own REPORT lines) against the cost
model's figure for the same run. JSON lines:

- ``{"bench": "lambda_fleet.gb_s", "repeat": r, ...}`` per run: Cora GCN, P x I, `--staleness none`, over W
  emulators (`infra/local/lambda.sh start --workers W --warm`): ``runtime_gb_s`` (sum over this run's
  invocations of Billed Duration x Memory Size from the emulators' logs), ``cost_model_gb_s`` (what the cost
  model bills: the duration each runtime timed itself, invocation start to handler end, rounded up to 1 ms,
  plus the init phase when cold, plus what the runtime did after the handler returned (its post of the
  response, timed by the runtime and reported in its next response; estimated by the run's mean for each
  instance's latest invocation), x memory; ``timed_by_runtime`` of the invocations were, the others billed
  their exchange), ``cost_model_same_invocations_gb_s`` (the same over the invocations with a REPORT line),
  ``ratio`` = runtime / cost model over the same invocations, invocations, retries, seconds, and the machine's load average at the start;
- ``{"bench": "lambda_fleet.summary", ...}``: the median ratio over the repeats, and the local pool's cost-model
  GB-seconds for the same config (busy time of each task in this process).

The first repeat includes each runtime's first compilation of the kernels (as a new Lambda instance would).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4, help="emulators")
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--intervals", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data-dir", default=os.environ.get("DORYLUS_DATA_DIR"))
    args = ap.parse_args(argv)

    import numpy as np

    from pipelines.config import TrainConfig
    from pipelines.data.registry import load_dataset
    from pipelines.engine.runner import train_engine

    state = tempfile.mkdtemp(prefix="dorylus-bench-lambda-")
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1", "DORYLUS_LAMBDA_STATE": state, "PYTHON": sys.executable}
    os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                           "DORYLUS_LAMBDA_STATE")})
    sh = os.path.join(REPO, "infra", "local", "lambda.sh")
    out = subprocess.run(["bash", sh, "start", "--workers", str(args.workers), "--warm", "--owner-pid",
                          str(os.getpid())], env=env, check=True, capture_output=True, text=True).stdout
    endpoints = ",".join(out.split())
    graph = load_dataset("cora", args.data_dir)
    base = dict(model="gcn", partitions=args.partitions, intervals=args.intervals, epochs=args.epochs,
                staleness=None)
    ratios = []
    try:
        for r in range(args.repeats):
            load = os.getloadavg()[0]
            res = train_engine(TrainConfig(**base, tensor_workers="aws", lambda_endpoint=endpoints).resolved(), graph)
            st, rr = res.summary["tensor_pool"], res.summary["cost"]["runtime_reported"]
            ratios.append(rr["ratio_to_cost_model"])
            emit({"bench": "lambda_fleet.gb_s", "repeat": r, "workers": args.workers, "epochs": args.epochs,
                  "runtime_gb_s": rr["lambda_gb_s"], "cost_model_gb_s": rr["cost_model_lambda_gb_s"],
                  "cost_model_same_invocations_gb_s": rr["cost_model_same_invocations_gb_s"],
                  "post_timed": st.get("billed_after_measured"), "post_estimated": st.get("billed_after_estimated"),
                  "ratio": rr["ratio_to_cost_model"], "invocations": st["invocations"],
                  "reported": rr["invocations"], "timed_by_runtime": st.get("billed_runtime_timed"),
                  "retries": st["retries"], "seconds": res.summary["seconds"],
                  "load_avg_1m": load})
        local = train_engine(TrainConfig(**base, tensor_workers=args.workers).resolved(), graph)
        emit({"bench": "lambda_fleet.summary", "repeats": args.repeats, "ratio_median": float(np.median(ratios)),
              "ratio_median_warm": float(np.median(ratios[1:])) if len(ratios) > 1 else None,
              "local_pool_cost_model_gb_s": local.summary["cost"]["usage"]["lambda_gb_s"]})
    finally:
        subprocess.run(["bash", sh, "stop"], env=env, check=False, capture_output=True)
    return 0


if __name__ == "__main__":
    from ops.host import reexec_with_huge_pages

    reexec_with_huge_pages()   # before anything is allocated: see ops.host.HUGE_PAGE_TUNABLE
    sys.exit(main())
