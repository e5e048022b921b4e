"""`python -m pipelines.infer ...`: full-graph inference with Beam (pipelines/beam/infer.py)."""
from pipelines.beam.infer import load_predictions, main, run  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
