"""Apache Beam pipelines: prepare a graph (the prepare/ package, one transform family per module), full-graph
inference (infer.py), runner flags (runners.py), and what both share: the stats combiners (combiners.py) and the
writers of shards and staged output folders (writers.py). Reading a prepared graph back: pipelines/data/prepared.py."""
