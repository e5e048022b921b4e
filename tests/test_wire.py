"""The bfloat16 wire format of the data channels (pipelines.transports.wire): rounding, codec, transports, runs."""
import ml_dtypes
import numpy as np
import pytest

from pipelines.config import ConfigError, TrainConfig
from pipelines.data.registry import load_dataset
from pipelines.engine.runner import train_engine
from pipelines.transports import codec, wire
from pipelines.transports.memory import MemoryTransport
from schemas.tasks import Channel, Message

RNG = np.random.default_rng(0)


def ghost_message(rows=64, width=32):
    return Message("SC", 3, 2, -1, 1, -1, arrays={
        "h": RNG.standard_normal((rows, width)).astype(np.float32),
        "vertex": np.arange(rows, dtype=np.int64) * 7}, meta={"name": "h"})


def test_narrowing_rounds_to_the_nearest_bfloat16_and_keeps_float32_range():
    h = np.array([[1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -9, -3.0e38], [1e-30, -2.5e-38, 0.1, 65504.0 * 16]], np.float32)
    norm = np.linspace(0.5, 2, 5, dtype=np.float32)  # rank 1: a norm or a loss, stays exact
    msg = Message("LAST", 1, 3, 0, 0, 1, arrays={"h": h, "norm": norm, "labels": np.arange(2, dtype=np.int32)},
                  meta={"seed": 3})
    n = wire.narrow(msg)
    assert n.meta == {"seed": 3, wire.NARROWED: ["h"]} and n.arrays["h"].dtype == np.uint16
    assert n.arrays["norm"] is norm and n.arrays["labels"] is msg.arrays["labels"]
    w = wire.widen(n)
    assert w.meta == {"seed": 3} and w.arrays["h"].dtype == np.float32 and w.arrays["h"].shape == h.shape
    got = w.arrays["h"]
    assert np.all(np.abs(got - h) <= np.abs(h) * 2.0 ** -8)  # half an ulp of 8 significant bits
    assert got[0, 0] == 1.0 and got[0, 1] == 1.0  # a tie rounds to even (1 + 2^-8 is halfway)
    assert got[0, 2] == np.float32(1 + 2 ** -7)  # above halfway rounds up
    assert got[1, 0] != 0 and got[1, 1] < 0 and np.isfinite(got).all()  # float32's range, unlike float16
    np.testing.assert_array_equal(got, h.astype(ml_dtypes.bfloat16).astype(np.float32))
    # values already on the bfloat16 grid cross unchanged: narrowing is idempotent
    np.testing.assert_array_equal(wire.widen(wire.narrow(w)).arrays["h"], got)
    assert wire.narrow(Message("WM", 1, 2, -1, 0, -1)).meta == {}  # nothing to narrow: the message as it was


def test_narrowed_rows_round_trip_the_kafka_codec_at_half_the_bytes():
    msg = ghost_message(512, 64)
    full = codec.encode(msg, "r")
    narrowed = wire.narrow(msg)
    data = codec.encode(narrowed, "r")
    assert len(data) < 0.6 * len(full)
    back = wire.widen(codec.decode(data, "r"))
    assert back.kind == msg.kind and back.meta == msg.meta and (back.epoch, back.stage) == (3, 2)
    np.testing.assert_array_equal(back.arrays["vertex"], msg.arrays["vertex"])
    np.testing.assert_array_equal(back.arrays["h"], wire.widen(narrowed).arrays["h"])


def test_the_transport_wrapper_narrows_only_the_data_channels():
    inner = MemoryTransport()
    t = wire.with_wire_dtype(inner, "bfloat16")
    assert isinstance(t, wire.NarrowedTransport) and wire.with_wire_dtype(t, "bfloat16") is t
    assert wire.with_wire_dtype(inner, "float32") is inner
    c_ghosts, c_grads = t.consumer([(Channel.GHOSTS, 0)]), t.consumer([(Channel.GRADS, 0)])
    msg = ghost_message()
    grad = Message("GRAD", 3, 1, 0, 0, 2, arrays={"av0/w": RNG.standard_normal((16, 8)).astype(np.float32)})
    t.send(Channel.GHOSTS, 0, msg)
    t.send(Channel.GRADS, 0, grad)
    sent = inner.stats()["bytes"]
    assert sent[Channel.GHOSTS] == msg.nbytes() - msg.arrays["h"].nbytes // 2
    assert sent[Channel.GRADS] == grad.nbytes()  # weight gradients stay float32
    (g,) = c_ghosts.poll(1.0)
    assert g.arrays["h"].dtype == np.float32 and wire.NARROWED not in g.meta
    assert np.max(np.abs(g.arrays["h"] - msg.arrays["h"])) > 0  # rounded
    (d,) = c_grads.poll(1.0)
    np.testing.assert_array_equal(d.arrays["av0/w"], grad.arrays["av0/w"])


def test_a_wire_dtype_outside_the_two_is_a_config_error():
    with pytest.raises(ConfigError, match="wire_dtype must be float32 or bfloat16"):
        TrainConfig(wire_dtype="float16").resolved()


@pytest.fixture(scope="module")
def planted():
    return load_dataset("synthetic:planted?nodes=2000&classes=10&degree=10&features=64", None, seed=0)


def test_a_bfloat16_run_halves_the_data_bytes_and_trains_as_float32_does(planted):
    def run(wire_dtype, staleness=0, warmup=0):
        cfg = TrainConfig(hidden=64, epochs=40, patience=0, partitions=4, intervals=2, staleness=staleness,
                          sync_warmup=warmup, wire_dtype=wire_dtype).resolved()
        return train_engine(cfg, planted)

    f32, b16 = run("float32"), run("bfloat16")
    wf, wb = f32.summary["wire"], b16.summary["wire"]
    assert wf["wire_dtype"] == "float32" and wb["wire_dtype"] == "bfloat16"
    assert 0.45 < wb["data_bytes_per_epoch"] / wf["data_bytes_per_epoch"] < 0.55
    # the minimum counts two bytes a value; what does not narrow (vertex ids, labels, masks) weighs twice as much
    assert wf["ratio_to_minimum"] <= wb["ratio_to_minimum"] < 1.3
    assert wb["bytes_per_epoch"][Channel.GRADS] == wf["bytes_per_epoch"][Channel.GRADS]
    assert [r["loss"] for r in b16.history] != [r["loss"] for r in f32.history]  # it did round
    assert abs(b16.summary["test_acc"] - f32.summary["test_acc"]) <= 0.01
    # deterministic under any timing, stale ghosts included; S=1 after the default warm-up of 20 synchronous
    # epochs (40 epochs from the first one stale are too few for the ghost average's lag: float32 too, 0.886)
    s1 = run("bfloat16", staleness=1, warmup=20)
    assert [r["loss"] for r in run("bfloat16", staleness=1, warmup=20).history] == [r["loss"] for r in s1.history]
    assert abs(s1.summary["test_acc"] - f32.summary["test_acc"]) <= 0.01
