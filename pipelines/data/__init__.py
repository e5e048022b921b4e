"""Graph data: the in-memory graph record, loaders, synthetic generators and the dataset registry."""
from pipelines.data.graph import Graph, DataError

__all__ = ["Graph", "DataError"]
