"""The model spec record, the parameter naming and the task vocabulary: one definition each, round trips."""
import io
import json

import numpy as np
import pytest

from ops import models
from ops import params as P
from ops.spec import CONFIG_FIELDS, ModelSpec
from pipelines.config import TrainConfig
import schemas
from schemas.tasks import TENSOR_TASK_KINDS, Channel, Lifecycle, StageKind, Step, TaskKind


@pytest.mark.parametrize("model", ["gcn", "gat"])
def test_model_spec_round_trips_and_builds_the_configured_model(model):
    cfg = TrainConfig(model=model, layers=3).resolved()
    spec = ModelSpec.from_config(cfg, 20, 5)
    back = ModelSpec.from_json(json.loads(json.dumps(spec.to_json())))
    assert back == spec
    if model == "gcn":
        want = models.gcn(20, (cfg.hidden,) * 2, 5, dropout=cfg.dropout, order=cfg.order)
        assert spec.to_json()["hidden"] == [cfg.hidden] * 2
    else:
        want = models.gat(20, cfg.hidden, 5, heads=cfg.heads, out_heads=cfg.out_heads, layers=3,
                          dropout=cfg.dropout)
    assert spec.build().stages == want.stages
    assert set(CONFIG_FIELDS) <= set(vars(cfg))


def test_model_spec_rejects_an_unknown_model():
    with pytest.raises(ValueError, match="unknown model 'sage2'"):
        ModelSpec.from_json({"name": "sage2"})


def test_params_flatten_unflatten_and_npz():
    tree = {"av0": {"w": np.ones((2, 3), np.float32), "b_out": np.zeros(3, np.float32)},
            "loss": {"b_in": np.arange(3, dtype=np.float32)}}
    flat = P.flatten(tree)
    assert sorted(flat) == ["av0/b_out", "av0/w", "loss/b_in"]
    assert P.stages_of(flat) == ["av0", "loss"] and sorted(P.stage_slice(flat, "av0")) == ["av0/b_out", "av0/w"]
    back = P.unflatten(flat)
    assert all(np.array_equal(back[s][n], tree[s][n]) for s in tree for n in tree[s])
    assert sorted(P.flatten(tree, prefix="params/")) == ["params/av0/b_out", "params/av0/w", "params/loss/b_in"]
    assert np.array_equal(P.read_like(P.flatten(tree, "x/"), tree, prefix="x/")["av0"]["w"], tree["av0"]["w"])
    buf = io.BytesIO()
    np.savez(buf, **flat)
    buf.seek(0)
    with np.load(buf) as z:
        got = P.from_npz(z)
    assert all(np.array_equal(got[s][n], tree[s][n]) for s in tree for n in tree[s])
    with pytest.raises(P.ParamNameError, match="'w' is not 'stage/param'"):
        P.unflatten({"w": 1}, strict=True)


def test_task_words_are_their_strings_on_the_wire():
    assert schemas.TaskKind is TaskKind
    assert TaskKind.AV == "AV" and hash(StageKind.GA) == hash("GA") and {"WM": 1}[TaskKind.WATERMARK] == 1
    assert f"{Channel.GHOST_GRADS}" == "ghosts.grad" and str(Step.BACKWARD) == "B"
    assert json.dumps({Lifecycle.STOP_AFTER: [TaskKind.LAST]}) == '{"STOP_AFTER": ["LAST"]}'
    assert [str(k) for k in TENSOR_TASK_KINDS] == ["AV", "AE", "LAST", "LOSS", "AV_BWD", "AE_BWD"]
    assert {s.kind for s in models.gat(4, 2, 3).stages} == set(StageKind)
