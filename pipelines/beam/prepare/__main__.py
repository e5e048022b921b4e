"""`python -m pipelines.beam.prepare ...`: the same as `python -m pipelines.prepare ...`."""
import sys

from pipelines.beam.prepare.pipeline import main

sys.exit(main())
