"""Graph data: the in-memory graph record, loaders, synthetic generators, the dataset registry and the reader of
prepared graphs (prepared.py: the Beam prepare pipeline's shards, read without Beam)."""
from pipelines.data.graph import Graph, DataError
from pipelines.data.npz import load_npz
from pipelines.data.planetoid import load_planetoid
from pipelines.data.registry import fetch, known_datasets, load_dataset, resolve_data_dir, verify_dataset
from pipelines.data.synthetic import planted_partition, rmat

__all__ = [
    "Graph", "DataError",
    "load_dataset", "fetch", "resolve_data_dir", "known_datasets", "verify_dataset",
    "load_planetoid", "load_npz", "planted_partition", "rmat",
]
