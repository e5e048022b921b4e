"""The parameter server: versioned weights, weight stashing, and WU with optax (one step per epoch).

Small pieces with explicit state, optax style: `init(params) -> PSState`, `apply_epoch(state, ...) -> PSState`.
Versions count epochs: version v is the weights after the updates of epochs 0..v-1. `weight_version` is the
policy: by default epoch e uses version e, so the WU of epoch e-1 is a barrier and only ghost values are stale;
`StalenessMode.STALE` uses version max(e - S, 0), which lets epochs overlap but applies every gradient S steps
late, and Adam on delayed gradients oscillates on large graphs (see the README).
WU sums the intervals' gradients in (partition, interval) order and takes one optimizer step per epoch; `async`
folds each gradient into that sum as soon as the ones before it in that order are in (the WU overlaps the
backward passes), `sync` sums when the epoch is complete: the same numbers either way. Per-interval Adam steps
(SAG style, as before) mix gradients of the previous version into every step, and full-batch Adam oscillates on
such delayed gradients (README, 'Bounded staleness').
The backward pass uses the forward's version (stashing), and a run with the same seed gives the same numbers
however its tasks were timed.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
import time

import jax
import numpy as np
import optax

from ops.params import flatten, unflatten
from pipelines.engine.messages import EngineError
from schemas.tasks import Channel, Lifecycle, Message, StalenessMode, TaskKind


def staleness_at(epoch: int, staleness: int, sync_warmup: int = 0) -> int:
    """The bound epoch `epoch` runs under: 0 for the first `sync_warmup` epochs of a run (they read this epoch's
    ghost values and gradients, as S=0 does), S after. Staleness costs most while the values change fastest,
    the first epochs of full-batch Adam (README, 'Bounded staleness')."""
    return 0 if epoch < sync_warmup else staleness


def weight_version(epoch: int, staleness: int, mode: StalenessMode, start_epoch: int = 0, sync_warmup: int = 0) -> int:
    """The weight version epoch `epoch` runs its forward and backward passes with (a fixed one: deterministic)."""
    if mode is StalenessMode.STALE:
        return max(epoch - staleness_at(epoch, staleness, sync_warmup), start_epoch)
    return max(epoch, start_epoch)


def weights_due(epochs, steps, latest_version: int, version_for, stop_after: int) -> bool:
    """Every unfinished interval (epochs[i] <= stop_after) is at its first step and waits for a weight version
    newer than latest_version (version_for(epoch)): a graph server with nothing in flight then blocks on the
    weights channel (`GraphServer.run`; the planner's simulation, pipelines/plan/gs.py, wakes on it the same way)."""
    due = False
    for e, step in zip(epochs, steps):
        if e > stop_after:
            continue
        if step != 0 or latest_version >= version_for(e):
            return False
        due = True
    return due


@dataclasses.dataclass
class PSState:
    params: dict                       # current weights (numpy), version `version`
    opt_state: object
    version: int
    versions: dict                     # version -> weights still referenced (the stash)
    pending: dict                      # epoch -> {(partition, interval): {stage name: grads}}
    folded: dict = dataclasses.field(default_factory=dict)   # epoch -> (intervals summed so far, their sum)


def init(params: dict, tx: optax.GradientTransformation) -> PSState:
    params = jax.tree_util.tree_map(np.asarray, params)
    return PSState(params, tx.init(params), 0, {0: params}, {})


def fold(state: PSState, epoch: int, expected: list, param_stages: list[str]) -> int:
    """Add to epoch's running sum the gradients of the intervals next in `expected` order that are complete;
    returns how many are summed. A fixed order: the floating-point sum does not depend on arrival order."""
    done, total = state.folded.get(epoch, (0, None))
    got = state.pending.get(epoch, {})
    while done < len(expected) and len(got.get(expected[done], ())) == len(param_stages):
        g = {name: got[expected[done]][name] for name in param_stages}
        total = jax.tree_util.tree_map(np.array, g) if total is None else jax.tree_util.tree_map(np.add, total, g)
        done += 1
    state.folded[epoch] = (done, total)
    return done


@functools.lru_cache(maxsize=16)
def _step(tx: optax.GradientTransformation):
    """tx's update and its application as one jitted program (as the whole-graph trainer's step has them):
    run eagerly, optax's dozens of small ops took 7-9 ms per WU, on the critical path of every epoch whose
    forward waits for the last WU (the default at any S)."""
    def step(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
    return jax.jit(step)


def apply_epoch(state: PSState, tx, epoch: int, expected: list, param_stages: list[str], keep_from: int) -> PSState:
    """WU for one complete epoch: sum every interval's gradients (in `expected` order) and step once. Then
    publish version epoch+1 and drop versions below keep_from."""
    if fold(state, epoch, expected, param_stages) < len(expected):
        raise EngineError(f"WU of epoch {epoch} before all its gradients arrived")
    state.pending.pop(epoch)
    _, grads = state.folded.pop(epoch)
    params, opt_state = state.params, state.opt_state
    grads = {k: grads.get(k, jax.tree_util.tree_map(np.zeros_like, params[k])) for k in params}
    params, opt_state = _step(tx)(grads, opt_state, params)
    params = jax.tree_util.tree_map(np.asarray, params)
    versions = {v: w for v, w in state.versions.items() if v >= keep_from}
    versions[epoch + 1] = params
    return PSState(params, opt_state, epoch + 1, versions, state.pending, state.folded)


class ParameterServer:
    """The WU role: collects dW messages, applies them when an epoch is complete, broadcasts versions."""

    def __init__(self, transport, params: dict, tx, *, partitions: int, intervals: int, param_stages: list[str],
                 mode: str, staleness: int | None, epochs: int, on_version=None):
        self.transport = transport
        self.tx = tx
        self.state = init(params, tx)
        self.expected = [(p, i) for p in range(partitions) for i in range(intervals)]
        self.param_stages = param_stages
        self.mode = mode
        self.staleness = staleness or 0
        self.epochs = epochs
        self.partitions = partitions
        self.intervals = intervals
        self.on_version = on_version
        self.busy_s = 0.0
        self.updates = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._consumer = transport.consumer([(Channel.GRADS, 0), (Channel.CONTROL, 0)], group="param-server")
        self._lock = threading.Lock()
        self.spans = None  # a SpanLog, set by the driver to record the timeline

    def weights(self, version: int) -> dict:
        with self._lock:
            if version not in self.state.versions:
                raise EngineError(f"weight version {version} does not exist (stashed: "
                                  f"{sorted(self.state.versions)})")
            return self.state.versions[version]

    def publish(self, version: int) -> None:
        w = self.weights(version)
        keep = min(self.state.versions)
        msg = Message(TaskKind.WEIGHTS, version - 1, -1, -1, 0, version, arrays=flatten(w), meta={"retire_below": keep})
        self.transport.send(Channel.WEIGHTS, 0, msg)
        if self.on_version:
            self.on_version(version, w)

    def handle(self, msg: Message) -> None:
        if msg.kind == Lifecycle.STOP:
            self._stop.set()
            return
        if msg.kind == Lifecycle.STOP_AFTER:
            return  # early stopping is for graph servers (it shares control partition 0 with graph server 0)
        if msg.kind != TaskKind.GRAD:
            raise EngineError(f"parameter server got an unexpected {msg.kind} message")
        e = msg.epoch
        if e < self.state.version and msg.version <= e:
            return  # a relaunched task's duplicate, for an epoch already applied
        if msg.version not in self.state.versions:
            raise EngineError(f"gradient of epoch {e} computed with weight version {msg.version}, "
                              f"which does not exist")
        slot = self.state.pending.setdefault(e, {}).setdefault((msg.partition, msg.interval), {})
        stage = msg.meta["stage_name"]
        if stage in slot:
            return  # duplicate from a relaunched straggler
        slot[stage] = unflatten(msg.arrays)[stage] if "/" in next(iter(msg.arrays), "") else msg.arrays
        if self.mode == "async":
            with self._lock:
                fold(self.state, e, self.expected, self.param_stages)
        self._maybe_apply()

    def _complete(self, e: int) -> bool:
        got = self.state.pending.get(e, {})
        if len(got) < len(self.expected):
            return False
        return all(len(got[k]) == len(self.param_stages) for k in self.expected)

    def _maybe_apply(self) -> None:
        while self._complete(self.state.version):
            e = self.state.version
            t0 = time.monotonic()
            # Versions still needed: those of epochs that may still be running backward passes (stashing).
            keep_from = max(0, e + 1 - self.staleness)
            with self._lock:
                self.state = apply_epoch(self.state, self.tx, e, self.expected, self.param_stages, keep_from)
            t1 = time.monotonic()
            self.busy_s += t1 - t0
            if self.spans is not None:
                self.spans.add("param-server", TaskKind.WU, e, -1, t0, t1)
            self.updates += 1
            self.publish(e + 1)

    def run(self) -> None:
        try:
            self.publish(self.state.version)  # 0, or the checkpointed version a resumed run continues from
            while not self._stop.is_set():
                for msg in self._consumer.poll(0.05):
                    self.handle(msg)
                self._consumer.commit()
        except BaseException as e:  # surfaced by the runner
            self.error = e
        finally:
            self._consumer.close()

    def stop(self) -> None:
        self._stop.set()
