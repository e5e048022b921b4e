"""Kafka-driven continuous training on a changing graph: graph-change events in, model versions out.

- :mod:`.stream`: `dorylus stream` (the consumer, the evolving graph, rounds, checkpoints, exactly-once resume)
- :mod:`.state`: the partitioned mutable graph
- :mod:`.watermark`: event-time watermarks and round cuts
- :mod:`.checkpoint`: the one-file atomic checkpoint
- :mod:`.replay`: `dorylus replay` (a dataset as a timed event stream)
"""
