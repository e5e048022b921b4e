"""`python -m pipelines.prepare ...`: the Beam prepare pipeline (pipelines/beam/prepare/pipeline.py)."""
from pipelines.beam.prepare import main, run  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
