"""Apache Beam pipelines: prepare/partition a graph (prepare.py), runner flags (runners.py), shard readers (shards.py)."""
