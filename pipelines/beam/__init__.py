"""Apache Beam pipelines: prepare a graph (prepare.py), full-graph inference (infer.py), runner flags
(runners.py), shard readers (shards.py)."""
