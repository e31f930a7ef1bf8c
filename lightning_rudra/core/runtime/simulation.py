"""The runtime model itself: a discrete-event simulation (heapq) of λ learners, their hosts' links and the
servers, under each protocol: :class:`Simulation` and :func:`simulate`, on :class:`Resources` (the event queue,
the cores, the links and the servers' queues).

Each learner loops: compute (its step time) → push, split evenly over the servers, each part over its host's link
(serialized: one message at a time per direction) → each server takes the part in turn (FIFO, its time per push) →
the protocol decides (once every part is in: the servers stand for one logical server, as their clocks move
together) → an update, when due, costs each server its time per update → the reply comes back over the links →
the batch ends and the next step starts. The epoch ends when ``batches`` gradients were applied (a wasted batch is
dealt again); the learners meet at every epoch's end, as under Lightning's end-of-epoch collectives.
"""

import bisect
import heapq
import random
from dataclasses import dataclass, field
from functools import partial
from typing import Optional

from lightning_rudra.core.runtime.prediction import Prediction
from lightning_rudra.core.runtime.records import Records
from lightning_rudra.core.runtime.resources import ARRIVE, COMPUTED, REPLY, SHARD, Resources
from lightning_rudra.core.runtime.scenario import Scenario
from lightning_rudra.core.runtime.ssp_gate import SspGate


@dataclass
class _Push:
    """One push: the learners whose gradients it carries (one, or a host's under node aggregation)."""

    members: list[int]
    host: int
    timestamp: int
    parts_left: int
    ready: float = 0.0


@dataclass
class _Reply:
    members: list[int]
    parts_left: int


@dataclass
class _State:
    """The protocol's state: the clock, gradients towards the open update, who waits for it (hardsync, and the
    pushes that close an update), SSP's held pushes and the clock each learner was handed."""

    clock: int = 0
    received: int = 0
    waiting: list[_Push] = field(default_factory=list)
    held: list[_Push] = field(default_factory=list)
    handed: dict[int, int] = field(default_factory=dict)
    members: set[int] = field(default_factory=set)  # learners whose gradient the open update holds


class Simulation(Resources):
    """One scenario's simulation; :meth:`run` returns the :class:`Prediction`."""

    def __init__(self, scenario: Scenario) -> None:
        super().__init__(scenario)
        c = scenario.cluster
        self.learners = c.learners
        self.proto = scenario.protocol
        self.aggregate = (
            self.proto.name == "hardsync" and not self.proto.backup and c.node_aggregation and c.learners_per_host > 1
        )
        self.shard = scenario.payload.parameters / c.num_servers
        self.push_part = scenario.payload.push_bytes / c.num_servers
        self.pull_part = scenario.payload.pull_bytes / c.num_servers
        self.rngs = [random.Random(scenario.seed * 1_000_003 + r) for r in range(self.learners)]
        self.step_times = [scenario.step_time(r) for r in range(self.learners)]
        self.machine = [c.machine_of_host(c.host_of_learner(r)) for r in range(self.learners)]
        # bf16's CPU cost: a learner's, per step, for the parts it sends to servers on other hosts
        pay = scenario.payload
        self.codec = pay.compression != "none" and (pay.learner_codec or pay.server_codec) > 0
        self.learner_codec = [
            pay.learner_codec
            * self.shard
            * sum(c.host_of_server(i) != c.host_of_learner(r) for i in range(c.num_servers))
            if self.codec
            else 0.0
            for r in range(self.learners)
        ]
        self.steps = [0] * self.learners  # computes started, over the run (the step index of the step times)
        self.timestamp = [0] * self.learners  # the clock of the weights each learner holds
        self.state = _State(handed={r: 0 for r in range(self.learners)})
        self.active = set(range(self.learners))
        self.ready: dict[int, list[int]] = {}  # node aggregation: per host, learners whose gradient is summed
        self.applied = self.inflight = 0
        self.records = Records(self.learners)
        self.held_since: dict[int, float] = {}
        bound = self.proto.max_staleness
        per_update = self.proto.gradients_per_update(self.learners)
        self.gate = SspGate(bound, self.learners, per_update) if bound is not None else None
        # σ as server 0 counts it: a learner on its host with shared memory reads the newest weights on its reply
        self.reads_latest = [
            c.shared_memory and c.host_of_learner(r) == c.host_of_server(0) for r in range(self.learners)
        ]
        # batchsync's pacing: the next compute time each learner will draw (drawn ahead from its own generator:
        # the same draws), and per learner handed weights it computes on, (their clock, when its compute ends);
        # per clock, those ends sorted
        self.paced = self.proto.name == "batchsync"
        self.drawn: dict[int, float] = {}
        self.computing: dict[int, tuple[int, float]] = {}
        self.ends: dict[int, list[float]] = {}

    def run(self) -> Prediction:
        for _ in range(self.s.epochs):
            self._epoch()
        return self.records.prediction(self.s, self.server_busy, self.parts)

    def _epoch(self) -> None:
        self.applied = self.inflight = 0
        self.active = set(range(self.learners))
        for r in range(self.learners):
            self._enter(r)
        for r in range(self.learners):
            self._start(r)
        while self.events:
            self.now, _, _, _, call, args = heapq.heappop(self.events)
            call(*args)
        self.records.epoch_ends.append(self.now)

    # a learner's loop
    def _start(self, learner: int) -> None:
        if self.applied + self.inflight >= self.s.batches:  # no batch left this epoch: it finishes
            self._finish(learner)
            return
        self.inflight += 1
        self.records.starts[learner].append(self.now)
        step = self.step_times[learner]
        duration = self._draw(learner) + self.learner_codec[learner]
        self.drawn.pop(learner, None)
        self.steps[learner] += 1
        if self.paced:
            self._computes(learner, self.timestamp[learner], self.now + duration + step.sleep + step.spin)
        machine = self.machine[learner]
        if not (step.sleep or step.spin) and not self.shared:  # the common case, one event
            self._at(self.now + duration, COMPUTED, learner, self._computed, learner)
            return

        def waited() -> None:
            self._at(self.now + step.sleep, COMPUTED, learner, self._computed, learner)

        def computed() -> None:
            if step.spin:
                self._hold(machine, step.spin, waited)
            else:
                waited()

        self._work(machine, duration, computed)

    def _draw(self, learner: int) -> float:
        """The compute time of ``learner``'s next step (drawn once, whether asked ahead or when it starts)."""
        if learner not in self.drawn:
            self.drawn[learner] = self.step_times[learner].sample(self.rngs[learner], self.steps[learner])
        return self.drawn[learner]

    def _computed(self, learner: int) -> None:
        host = self.s.cluster.host_of_learner(learner)
        if not self.aggregate:
            self._send(_Push([learner], host, self.timestamp[learner], self.parts))
            return
        ready = self.ready.setdefault(host, [])
        ready.append(learner)
        self._send_host(host)

    def _send_host(self, host: int) -> None:
        """Node aggregation: the host's push goes once every learner of it still training has its gradient."""
        ready = self.ready.get(host, [])
        lph = self.s.cluster.learners_per_host
        mine = [r for r in range(host * lph, (host + 1) * lph) if r in self.active]
        if ready and set(mine) <= set(ready):
            self.ready[host] = []
            self._send(_Push(sorted(ready), host, self.timestamp[ready[0]], self.parts))

    def _send(self, push: _Push) -> None:
        whole = self.s.payload.push_bytes if self.parts == 1 else self.push_part
        for server in range(self.parts):
            target = self.s.cluster.host_of_server(server)
            self._transfer(push.host, target, whole, self.push_part, SHARD, push.members[0], self._shard, push, server)

    def _shard(self, push: _Push, server: int) -> None:
        seconds = self.s.server.push(self.shard)
        if self.codec and push.host != self.s.cluster.host_of_server(server):
            seconds += self.s.payload.server_codec * self.shard
        self._serve(server, seconds, lambda: self._shard_done(push))

    def _shard_done(self, push: _Push) -> None:
        push.parts_left -= 1
        if not push.parts_left:
            self._at(self.now, ARRIVE, push.members[0], self._arrive, push)

    # the protocol
    def _arrive(self, push: _Push) -> None:
        for r in push.members:
            self.records.arrivals[r].append(self.now)
            if self.paced:
                self._computes(r, None)
        self.inflight -= len(push.members)
        name, st = self.proto.name, self.state
        if name in ("hardsync", "batchsync") and push.timestamp < st.clock:
            # late for its round, or computed on old weights: its batch is dealt again
            self.records.wasted += len(push.members)
            self.records.wastes.append(self.now)
            self._answer(push)
            self._wake()
            self._release_if_short()
            return
        if self.gate is not None and not self._may_take(push):
            st.held.append(push)
            self.held_since[push.members[0]] = self.now
            self._enter(push.members[0])
            return
        self._take(push)
        self._release()
        self._release_if_short()

    def _take(self, push: _Push) -> None:
        st = self.state
        sigma = st.clock - push.timestamp
        for r in push.members:
            self.records.takes.append((self.now, r, push.timestamp, sigma))
        self.applied += len(push.members)
        st.received += len(push.members)
        st.members.update(push.members)
        st.waiting.append(push)
        if self._due():
            self._update()
        elif self.proto.name != "hardsync" and not (self.paced and self._waits(push)):
            st.waiting.remove(push)  # replies at once, with the current weights
            self._answer(push)

    def _due(self) -> bool:
        st, name = self.state, self.proto.name
        if name == "hardsync":
            return st.received >= len(self.active) - self.proto.backup or self.active <= st.members
        return st.received >= self.proto.gradients_per_update(self.learners)

    def _update(self) -> None:
        """An update closes: each server steps its part; the pushes that wait get the new weights once it is done."""
        st = self.state
        st.clock += 1
        self.records.updates += 1
        self.records.update_times.append(self.now)
        st.received = 0
        st.members = set()
        waiting, st.waiting = st.waiting, []
        replies = [(push, self._hand(push)) for push in waiting]
        for server in range(self.parts):
            self._serve(server, self.s.server.update(self.shard), partial(self._reply_from, server, replies))

    def _hand(self, push: _Push) -> _Reply:
        """``push``'s learners are handed the weights of the clock now."""
        for r in push.members:
            self.timestamp[r] = self.state.clock
            if self.paced:  # its reply's way back, then its next compute
                self._computes(r, self.state.clock, self.now + self._back(push.host) + self._nominal(r))
            if self.gate is not None:
                self.gate.handing(self.state.handed[r])
            self.state.handed[r] = self.state.clock
            self._enter(r)
        return _Reply(push.members, self.parts)

    def _answer(self, push: _Push) -> None:
        """Reply to ``push`` now with the weights of the clock now."""
        reply = self._hand(push)
        for server in range(self.parts):
            self._reply_from(server, [(push, reply)])

    def _reply_from(self, server: int, replies: list[tuple[_Push, _Reply]]) -> None:
        """Server ``server``'s part of each reply leaves now."""
        whole = self.s.payload.pull_bytes if self.parts == 1 else self.pull_part
        for push, reply in replies:
            source = self.s.cluster.host_of_server(server)
            self._transfer(source, push.host, self.pull_part, whole, REPLY, push.members[0], self._reply, reply)

    def _reply(self, reply: _Reply) -> None:
        reply.parts_left -= 1
        if reply.parts_left:
            return
        for r in reply.members:
            if self.reads_latest[r]:  # read from shared memory now: the newest weights
                self.timestamp[r] = self.state.clock
            self.records.batch_ends[r].append(self.now)
            self._start(r)

    def _finish(self, learner: int) -> None:
        """No batch left for ``learner``: rounds and SSP wait for it no more (as Server.finish)."""
        self.active.discard(learner)
        self._enter(learner)
        if self.aggregate:
            self._send_host(self.s.cluster.host_of_learner(learner))
        st = self.state
        if self.paced:
            self._computes(learner, None)
            self._release_if_short()
        elif st.waiting and (self._due() or not self.active):
            self._update()
        self._release()

    def _wake(self) -> None:
        """A wasted gradient gave its batch back: a learner that had finished takes it."""
        idle = sorted(set(range(self.learners)) - self.active)
        if idle and self.applied + self.inflight < self.s.batches:
            self.active.add(idle[0])
            self._enter(idle[0])
            self._start(idle[0])

    # batchsync's pacing (lightning_rudra.server.pacing.RoundPacing's rule, with the true durations, as
    # lightning_rudra.core.rounds_order does)
    def _computes(self, learner: int, clock: Optional[int], end: float = 0.0) -> None:
        """``learner`` computes on the weights of ``clock`` until ``end`` (None: it computes no more)."""
        old = self.computing.pop(learner, None)
        if old is not None:
            ends = self.ends[old[0]]
            del ends[bisect.bisect_left(ends, old[1])]
            if not ends:
                del self.ends[old[0]]
        if clock is not None:
            self.computing[learner] = (clock, end)
            bisect.insort(self.ends.setdefault(clock, []), end)

    def _nominal(self, learner: int) -> float:
        """``learner``'s next step in wall seconds: its compute (one core's) and its sleep or spin."""
        step = self.step_times[learner]
        return self._draw(learner) + self.learner_codec[learner] + step.sleep + step.spin

    def _back(self, host: int) -> float:
        """A reply's way from the servers to ``host``, the links idle."""
        cluster, size = self.s.cluster, self.pull_part
        slowest = 0.0
        for server in range(self.parts):
            link = cluster.local if cluster.host_of_server(server) == host else cluster.link
            whole = self.s.payload.pull_bytes if self.parts == 1 else size
            slowest = max(slowest, link.seconds(max(size, whole)) + link.latency + link.overhead(max(size, whole)))
        return slowest

    def _waits(self, push: _Push) -> bool:
        """Whether ``push``'s reply waits for the round: the gradients computing on the current weights (each due
        when its compute ends) would close it no later than its learner's next one (its reply's way back and its
        next step; the pushes' ways there taken as equal)."""
        st = self.state
        needed = self.proto.gradients_per_update(self.learners) - st.received
        ends = self.ends.get(st.clock, [])
        if needed <= 0 or len(ends) < needed:
            return False
        learner = push.members[0]
        return self.now + self._back(push.host) + self._nominal(learner) >= ends[needed - 1]

    def _release_if_short(self) -> None:
        """Replies waiting for a round the learners computing on its weights can no longer close go now."""
        st = self.state
        if not (self.paced and st.waiting):
            return
        needed = self.proto.gradients_per_update(self.learners) - st.received
        if len(self.ends.get(st.clock, ())) >= needed:
            return
        waiting, st.waiting = st.waiting, []
        for push in sorted(waiting, key=lambda p: p.members[0]):
            self._answer(push)

    # SSP (runtime/ssp_gate.py)
    def _may_take(self, push: _Push) -> bool:
        assert self.gate is not None
        st = self.state
        return self.gate.may_take(push.members[0], push.timestamp, st.clock, st.received, st.handed)

    def _enter(self, learner: int) -> None:
        """SSP: ``learner``'s clock in the gate, as it is now (none: inactive and not held)."""
        if self.gate is None:
            return
        held = next((p.timestamp for p in self.state.held if p.members[0] == learner), None)
        if held is not None:
            now: Optional[int] = held
        else:
            now = self.state.handed[learner] if learner in self.active else None
        self.gate.enter(learner, now)

    def _release(self) -> None:
        st = self.state
        while st.held:
            ready: Optional[_Push] = next(
                (p for p in sorted(st.held, key=lambda p: p.timestamp) if self._may_take(p)), None
            )
            if ready is None:
                return
            st.held.remove(ready)
            self._enter(ready.members[0])
            self.records.held_s += self.now - self.held_since.pop(ready.members[0], self.now)
            self._take(ready)


def simulate(scenario: Scenario) -> Prediction:
    """The runtime model's prediction for ``scenario``."""
    return Simulation(scenario).run()
