"""Kafka-driven continuous training on a changing graph: graph-change events in, model versions and predictions out.

- :mod:`.stream`: `dorylus stream` (options, the round loop, training, predictions of each version)
- :mod:`.ingest`: the consumer thread (decode, check, dedupe, pending events)
- :mod:`.dedupe`: bounded exactly-once dedupe (event-id hashes per event-time window, behind a horizon)
- :mod:`.state`: the graph as growable arrays, batches of events applied column-wise
- :mod:`.trainer`: warm-started whole-graph rounds on capacity buckets (one compile per bucket)
- :mod:`.predictions`: the k-hop set of a change, the predictions topic, `dorylus predictions`
- :mod:`.persist` / :mod:`.checkpoint`: incremental checkpoints (base + deltas), resume, the run's files
- :mod:`.watermark`: event-time watermarks and round cuts
- :mod:`.replay`: `dorylus replay` (a dataset as a timed event stream)
"""
