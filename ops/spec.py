"""The model's identity: one record naming the architecture and its sizes, built from a config and a graph's
sizes, written to JSON (what a stateless tensor worker receives) and read back, and built into a Model."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ops import models

#: the config fields that decide the architecture (with the graph's feature and class counts)
CONFIG_FIELDS = ("model", "hidden", "layers", "heads", "out_heads", "order")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """name: "gcn", "sage" or "gat"; in_dim / num_classes: the graph's feature and class counts; hidden: the
    widths of the hidden layers (GCN and GraphSAGE, one per hidden layer) or the per-head width (GAT); heads /
    out_heads / layers: GAT only; order: GCN/GraphSAGE stage order ("auto", "ga-first", "av-first")."""

    name: str
    in_dim: int
    num_classes: int
    hidden: int | tuple[int, ...]
    dropout: float
    order: str = "auto"
    heads: int = 0
    out_heads: int = 0
    layers: int = 0

    @classmethod
    def from_config(cls, cfg: Any, in_dim: int, num_classes: int) -> "ModelSpec":
        """The model a config (any object with the CONFIG_FIELDS and dropout) names, for these sizes."""
        if cfg.model in ("gcn", "sage"):
            return cls(cfg.model, int(in_dim), int(num_classes), (cfg.hidden,) * (cfg.layers - 1), cfg.dropout,
                       order=cfg.order)
        return cls("gat", int(in_dim), int(num_classes), cfg.hidden, cfg.dropout, heads=cfg.heads,
                   out_heads=cfg.out_heads, layers=cfg.layers)

    @classmethod
    def for_graph(cls, cfg: Any, graph: Any) -> "ModelSpec":
        """`from_config` with the sizes of a graph (``feature_dim``, ``num_classes``)."""
        return cls.from_config(cfg, graph.feature_dim, graph.num_classes)

    def to_json(self) -> dict:
        """The JSON-able form (the ``model`` of a tensor task); `from_json` reads it back."""
        if self.name in ("gcn", "sage"):
            return {"name": self.name, "in_dim": self.in_dim, "hidden": list(self.hidden),
                    "num_classes": self.num_classes, "dropout": self.dropout, "order": self.order}
        return {"name": "gat", "in_dim": self.in_dim, "hidden": self.hidden, "num_classes": self.num_classes,
                "heads": self.heads, "out_heads": self.out_heads, "layers": self.layers, "dropout": self.dropout}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ModelSpec":
        """The spec of a `to_json` dict; ValueError names an unknown model."""
        d = dict(d)
        name = d.pop("name", None)
        if name in ("gcn", "sage"):
            return cls(name, d["in_dim"], d["num_classes"], tuple(d["hidden"]), d["dropout"],
                       order=d.get("order", "auto"))
        if name == "gat":
            return cls("gat", d["in_dim"], d["num_classes"], d["hidden"], d["dropout"], heads=d["heads"],
                       out_heads=d["out_heads"], layers=d["layers"])
        raise ValueError(f"unknown model {name!r} in task spec")

    def build(self) -> models.Model:
        """The Model (its stages, initializer and weight-decay mask)."""
        return models.from_spec(self.to_json())

    @staticmethod
    def output_width_per_class(cfg: Any, params: Mapping[str, Any] | None = None) -> int:
        """How many columns of the last AV's weight one class takes (GAT: one per output head; an AV-first
        GraphSAGE last layer, recognised by its separate loss stage in ``params``, writes [h W_self, h W_neigh])."""
        if cfg.model == "gat":
            return cfg.out_heads
        return 2 if cfg.model == "sage" and params is not None and "loss" in params else 1
