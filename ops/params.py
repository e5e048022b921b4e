"""Model parameters by name: the nested {stage: {param: array}} tree and its flat ``"stage/param"`` naming.

The flat naming is what travels (weight versions, gradients, Lambda payloads) and what ``weights.npz`` holds;
every module that flattens or rebuilds a parameter tree does it here.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

SEP = "/"


class ParamNameError(ValueError):
    """A flat parameter name is not ``stage/param``."""


def flatten(params: Mapping[str, Mapping], prefix: str = "") -> dict[str, np.ndarray]:
    """{stage: {param: array}} -> {"<prefix>stage/param": numpy array}."""
    return {f"{prefix}{stage}{SEP}{n}": np.asarray(v) for stage, p in params.items() for n, v in p.items()}


def unflatten(flat: Mapping[str, object], strict: bool = False) -> dict:
    """{"stage/param": array} -> {stage: {param: array}}; the arrays are kept as they are.

    strict: a name without a separator is a ParamNameError (otherwise it is one, too, from the split)."""
    out: dict = {}
    for k, v in flat.items():
        if strict and SEP not in k:
            raise ParamNameError(f"parameter name {k!r} is not 'stage/param'")
        stage, name = k.split(SEP, 1)
        out.setdefault(stage, {})[name] = v
    return out


def stages_of(flat: Mapping[str, object]) -> list[str]:
    """The stage names a flat mapping holds, sorted."""
    return sorted({k.split(SEP, 1)[0] for k in flat})


def stage_slice(flat: Mapping[str, object], stage: str) -> dict:
    """The flat entries of one stage, names kept."""
    return {k: v for k, v in flat.items() if k.startswith(stage + SEP)}


def read_like(flat: Mapping[str, object], template: Mapping[str, Mapping], prefix: str = "") -> dict:
    """The tree of `template`'s stages and names read from a flat mapping (``<prefix>stage/param``)."""
    return {s: {n: np.asarray(flat[f"{prefix}{s}{SEP}{n}"]) for n in p} for s, p in template.items()}


def from_npz(z) -> dict:
    """The parameter tree of an open ``weights.npz`` (numpy arrays)."""
    return {s: {n: np.asarray(v) for n, v in p.items()} for s, p in unflatten({k: z[k] for k in z.files}).items()}
