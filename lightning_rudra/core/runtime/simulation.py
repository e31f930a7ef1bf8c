"""The runtime model itself: a discrete-event simulation (heapq) of λ learners, their hosts' links and the
servers, under each protocol: :class:`Simulation` and :func:`simulate`.

Each learner loops: compute (its step time) → push, split evenly over the servers, each part over its host's link
(serialized: one message at a time per direction) → each server takes the part in turn (FIFO, its time per push) →
the protocol decides (once every part is in: the servers stand for one logical server, as their clocks move
together) → an update, when due, costs each server its time per update → the reply comes back over the links →
the batch ends and the next step starts. The epoch ends when ``batches`` gradients were applied (a wasted batch is
dealt again); the learners meet at every epoch's end, as under Lightning's end-of-epoch collectives.
"""

import heapq
import random
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_rudra.core.runtime.prediction import Prediction
from lightning_rudra.core.runtime.scenario import Scenario

# at one moment: computes end before parts arrive, before the protocol decides, before replies land; then by learner
COMPUTED, SHARD, ARRIVE, REPLY = range(4)


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


class Simulation:
    """One scenario's simulation; :meth:`run` returns the :class:`Prediction`."""

    def __init__(self, scenario: Scenario) -> None:
        self.s = scenario
        c = scenario.cluster
        self.learners = c.learners
        self.proto = scenario.protocol
        self.aggregate = (
            self.proto.name == "hardsync" and not self.proto.backup and c.node_aggregation and c.learners_per_host > 1
        )
        # servers on hosts of their own, each an equal share: all see the same pushes at the same moments, so one
        # stands for all (its link carries its share; a learner's link carries every share)
        self.parts = 1 if c.servers_on == "own_hosts" else c.num_servers
        self.shard = scenario.payload.parameters / c.num_servers
        self.push_part = scenario.payload.push_bytes / c.num_servers
        self.pull_part = scenario.payload.pull_bytes / c.num_servers
        self.now = 0.0
        self.events: list[tuple[float, int, int, int, Any]] = []
        self.seq = 0
        self.out_free = [0.0] * c.all_hosts
        self.in_free = [0.0] * c.all_hosts
        self.server_free = [0.0] * self.parts
        self.server_busy = [0.0] * self.parts
        self.rngs = [random.Random(scenario.seed * 1_000_003 + r) for r in range(self.learners)]
        self.steps = [0] * self.learners  # computes started, over the run (the step index of the step times)
        self.timestamp = [0] * self.learners  # the clock of the weights each learner holds
        self.state = _State(handed={r: 0 for r in range(self.learners)})
        self.active = set(range(self.learners))
        self.ready: dict[int, list[int]] = {}  # node aggregation: per host, learners whose gradient is summed
        self.applied = self.wasted = self.inflight = self.updates = 0
        self.epoch_ends: list[float] = []
        self.batch_ends: list[list[float]] = [[] for _ in range(self.learners)]
        self.takes: list[tuple[float, int, int, int]] = []  # time, learner, timestamp, σ
        self.wastes: list[float] = []
        self.arrivals: list[list[float]] = [[] for _ in range(self.learners)]
        self.starts: list[list[float]] = [[] for _ in range(self.learners)]
        self.held_s = 0.0
        self.update_times: list[float] = []
        self.held_since: dict[int, float] = {}

    # the event queue
    def _at(self, time: float, kind: int, learner: int, what: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (time, kind, learner, self.seq, what))

    def run(self) -> Prediction:
        for _ in range(self.s.epochs):
            self._epoch()
        return self._prediction()

    def _epoch(self) -> None:
        self.applied = self.inflight = 0
        self.active = set(range(self.learners))
        for r in range(self.learners):
            self._start(r)
        while self.events:
            self.now, kind, _, _, what = heapq.heappop(self.events)
            if kind == COMPUTED:
                self._computed(what)
            elif kind == SHARD:
                self._shard(*what)
            elif kind == ARRIVE:
                self._arrive(what)
            else:
                self._reply(what)
        self.epoch_ends.append(self.now)

    # a learner's loop
    def _start(self, learner: int) -> None:
        if self.applied + self.inflight >= self.s.batches:  # no batch left this epoch: it finishes
            self._finish(learner)
            return
        self.inflight += 1
        self.starts[learner].append(self.now)
        duration = self.s.step_time(learner).sample(self.rngs[learner], self.steps[learner])
        self.steps[learner] += 1
        self._at(self.now + duration, COMPUTED, learner, learner)

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
            arrival = self._transfer(push.host, self.s.cluster.host_of_server(server), whole, self.push_part)
            self._at(arrival, SHARD, push.members[0], (push, server))

    def _transfer(self, source: int, target: int, sent: float, received: float) -> float:
        """When a message sent now from host ``source`` arrives at ``target``: on one host a copy (no queue), between
        hosts once the sender's outgoing and the receiver's incoming side are both free, each held for the bytes it
        carries (``sent``, ``received``: they differ where one server stands for all)."""
        cluster = self.s.cluster
        if source == target:
            return self.now + cluster.local.seconds(max(sent, received)) + cluster.local.latency
        start = max(self.now, self.out_free[source], self.in_free[target])
        self.out_free[source] = start + cluster.link.seconds(sent)
        self.in_free[target] = start + cluster.link.seconds(received)
        return start + cluster.link.seconds(max(sent, received)) + cluster.link.latency

    def _serve(self, server: int, seconds: float) -> float:
        """The server's FIFO: the job starts once the server is free; returns when it is done."""
        start = max(self.now, self.server_free[server])
        self.server_free[server] = start + seconds
        self.server_busy[server] += seconds
        return start + seconds

    def _shard(self, push: _Push, server: int) -> None:
        push.ready = max(push.ready, self._serve(server, self.s.server.push(self.shard)))
        push.parts_left -= 1
        if not push.parts_left:
            self._at(push.ready, ARRIVE, push.members[0], push)

    # the protocol
    def _arrive(self, push: _Push) -> None:
        for r in push.members:
            self.arrivals[r].append(self.now)
        self.inflight -= len(push.members)
        name, st = self.proto.name, self.state
        if name in ("hardsync", "batchsync") and push.timestamp < st.clock:
            self.wasted += len(push.members)  # late for its round, or computed on old weights: its batch is dealt again
            self.wastes.append(self.now)
            self._answer(push, self.now)
            self._wake()
            return
        if self.proto.max_staleness is not None and not self._may_take(push):
            st.held.append(push)
            self.held_since[push.members[0]] = self.now
            return
        self._take(push)
        self._release()

    def _take(self, push: _Push) -> None:
        st = self.state
        sigma = st.clock - push.timestamp
        for r in push.members:
            self.takes.append((self.now, r, push.timestamp, sigma))
        self.applied += len(push.members)
        st.received += len(push.members)
        st.members.update(push.members)
        st.waiting.append(push)
        if self._due():
            self._update()
        elif self.proto.name != "hardsync":  # replies at once, with the current weights
            st.waiting.remove(push)
            self._answer(push, self.now)

    def _due(self) -> bool:
        st, name = self.state, self.proto.name
        if name == "hardsync":
            return st.received >= len(self.active) - self.proto.backup or self.active <= st.members
        return st.received >= self.proto.gradients_per_update(self.learners)

    def _update(self) -> None:
        """An update closes: each server steps its part; the pushes that wait get the new weights once it is done."""
        st = self.state
        st.clock += 1
        self.updates += 1
        self.update_times.append(self.now)
        st.received = 0
        st.members = set()
        done = [self._serve(server, self.s.server.update(self.shard)) for server in range(self.parts)]
        waiting, st.waiting = st.waiting, []
        for push in waiting:
            self._answer(push, done)

    def _answer(self, push: _Push, leave: Any) -> None:
        """Reply to ``push`` with the weights of the clock now, leaving each server at ``leave`` (one time, or one
        per server)."""
        for r in push.members:
            self.timestamp[r] = self.state.clock
            self.state.handed[r] = self.state.clock
        reply = _Reply(push.members, self.parts)
        whole = self.s.payload.pull_bytes if self.parts == 1 else self.pull_part
        for server in range(self.parts):
            at = leave[server] if isinstance(leave, list) else leave
            saved, self.now = self.now, at
            arrival = self._transfer(self.s.cluster.host_of_server(server), push.host, self.pull_part, whole)
            self.now = saved
            self._at(arrival, REPLY, push.members[0], reply)

    def _reply(self, reply: _Reply) -> None:
        reply.parts_left -= 1
        if reply.parts_left:
            return
        for r in reply.members:
            self.batch_ends[r].append(self.now)
            self._start(r)

    def _finish(self, learner: int) -> None:
        """No batch left for ``learner``: rounds and SSP wait for it no more (as Server.finish)."""
        self.active.discard(learner)
        if self.aggregate:
            self._send_host(self.s.cluster.host_of_learner(learner))
        st = self.state
        if st.waiting and (self._due() or not self.active):
            self._update()
        self._release()

    def _wake(self) -> None:
        """A wasted gradient gave its batch back: a learner that had finished takes it."""
        idle = sorted(set(range(self.learners)) - self.active)
        if idle and self.applied + self.inflight < self.s.batches:
            self.active.add(idle[0])
            self._start(idle[0])

    # SSP (lightning_rudra.core.ssp.StaleGate's rule, in plain Python)
    def _may_take(self, push: _Push) -> bool:
        st, learner = self.state, push.members[0]
        held = {p.members[0] for p in st.held}
        others = sorted(
            [t for who, t in st.handed.items() if who != learner and who in self.active and who not in held]
            + [p.timestamp for p in st.held if p.members[0] != learner]
        )
        if not others or push.timestamp <= others[0]:
            return True
        c = self.proto.gradients_per_update(self.learners)
        bound = self.proto.max_staleness
        assert bound is not None
        return all(st.clock + (st.received + 1 + m) // c - t <= bound for m, t in enumerate(others))

    def _release(self) -> None:
        st = self.state
        while st.held:
            ready: Optional[_Push] = next(
                (p for p in sorted(st.held, key=lambda p: p.timestamp) if self._may_take(p)), None
            )
            if ready is None:
                return
            st.held.remove(ready)
            self.held_s += self.now - self.held_since.pop(ready.members[0], self.now)
            self._take(ready)

    # the outcome
    def _prediction(self) -> Prediction:
        warm = self.s.warmup
        ends = self.batch_ends
        begin = max((e[warm - 1] if len(e) >= warm else 0.0) for e in ends) if warm else 0.0
        end = self.epoch_ends[-1] if self.epoch_ends else 0.0
        span = end - begin
        if span <= 0:  # too few batches to leave the warm-up: count the whole run
            begin, span = 0.0, end
        counted = sum(1 for e in ends for t in e if begin < t <= end)
        applied = [(r, ts, sigma) for t, r, ts, sigma in self.takes if begin < t <= end]
        wasted = sum(1 for t in self.wastes if begin < t <= end)
        staleness: dict[int, int] = {}
        for _, _, sigma in applied:
            staleness[sigma] = staleness.get(sigma, 0) + 1
        rate = 1 / span if span > 0 else 0.0
        total_wasted = self.wasted
        return Prediction(
            protocol=str(self.proto),
            learners=self.learners,
            samples_per_s=counted * self.s.batch_size * rate,
            applied_per_s=len(applied) * rate,
            computed_per_s=(len(applied) + wasted) * rate,
            staleness=dict(sorted(staleness.items())),
            wasted=total_wasted / (len(self.takes) + total_wasted) if self.takes or total_wasted else 0.0,
            epoch_s=end / len(self.epoch_ends) if self.epoch_ends else 0.0,
            updates=self.updates,
            server_utilisation=[b / end if end else 0.0 for b in self.server_busy]
            * (self.s.cluster.num_servers // self.parts),
            push_order=[(r, ts) for _, r, ts, _ in self.takes],
            arrivals=self.arrivals,
            round_starts=self.starts if self.proto.name == "hardsync" else [[] for _ in self.starts],
            held_s=self.held_s,
            update_times=self.update_times,
        )


def simulate(scenario: Scenario) -> Prediction:
    """The runtime model's prediction for ``scenario``."""
    return Simulation(scenario).run()
