"""The resources of the runtime model's discrete-event simulation (heapq): the event queue, each machine's cores
under processor sharing, the links between hosts and each server's queue. :class:`Resources` schedules work on
them; :class:`~lightning_rudra.core.runtime.simulation.Simulation` runs the learners and the protocol on top.
"""

import heapq
import math
from collections import deque
from typing import Any, Callable

from lightning_rudra.core.runtime.scenario import Scenario

# at one moment: computes (and CPU work) end before parts arrive, before the protocol decides, before replies land;
# then by learner
COMPUTED, SHARD, ARRIVE, REPLY = range(4)


class _Cpu:
    """One machine's cores under processor sharing: each of n busy processes runs at min(1, cores / n) of a core.
    ``jobs``: CPU work left (core-seconds) and what to call once done; ``holds``: processes busy for a set wall time
    (busy-waiting)."""

    def __init__(self, cores: float) -> None:
        self.cores = cores
        self.jobs: dict[int, list[Any]] = {}
        self.holds = 0
        self.last = 0.0
        self.version = 0

    def rate(self) -> float:
        busy = len(self.jobs) + self.holds
        return min(1.0, self.cores / busy) if busy else 1.0

    def advance(self, now: float) -> None:
        done = (now - self.last) * self.rate()
        if done:
            for job in self.jobs.values():
                job[0] -= done
        self.last = now


class Resources:
    """The event queue, cores, links and server queues of one scenario (``s``)."""

    def __init__(self, scenario: Scenario) -> None:
        self.s = scenario
        c = scenario.cluster
        # servers on hosts of their own, each an equal share: all see the same pushes at the same moments, so one
        # stands for all (its link carries its share; a learner's link carries every share)
        self.parts = 1 if c.servers_on == "own_hosts" else c.num_servers
        self.now = 0.0
        self.events: list[tuple[float, int, int, int, Callable[..., None], tuple[Any, ...]]] = []
        self.seq = 0
        self.out_free = [0.0] * c.all_hosts
        self.in_free = [0.0] * c.all_hosts
        self.server_busy = [0.0] * self.parts
        self.shared = c.cores != math.inf
        self.cpus = [_Cpu(c.cores) for _ in range(1 if c.one_machine else c.all_hosts)] if self.shared else []
        self.jobs = 0
        self.queues: list[deque[tuple[float, Callable[[], None]]]] = [deque() for _ in range(self.parts)]

    # the event queue
    def _at(self, time: float, kind: int, learner: int, call: Callable[..., None], *args: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (time, kind, learner, self.seq, call, args))

    # the cores
    def _work(self, machine: int, seconds: float, then: Callable[[], None], kind: int = COMPUTED) -> None:
        """``seconds`` of CPU work on ``machine``; ``then`` once done (at once, without sharing: its wall time)."""
        if not self.shared:
            self._at(self.now + seconds, kind, 0, then)
            return
        cpu = self.cpus[machine]
        cpu.advance(self.now)
        self.jobs += 1
        cpu.jobs[self.jobs] = [seconds, then]
        self._next(machine)

    def _hold(self, machine: int, seconds: float, then: Callable[[], None]) -> None:
        """A process busy ``seconds`` of wall time on ``machine`` (busy-waiting), holding its share of the cores."""
        if not self.shared:
            self._at(self.now + seconds, COMPUTED, 0, then)
            return
        cpu = self.cpus[machine]
        cpu.advance(self.now)
        cpu.holds += 1
        self._next(machine)

        def release() -> None:
            cpu.advance(self.now)
            cpu.holds -= 1
            self._next(machine)
            then()

        self._at(self.now + seconds, COMPUTED, 0, release)

    def _next(self, machine: int) -> None:
        """Schedule the next job to end on ``machine`` (a newer schedule voids this one)."""
        cpu = self.cpus[machine]
        cpu.version += 1
        if cpu.jobs:
            left = min(job[0] for job in cpu.jobs.values())
            self._at(self.now + max(left, 0.0) / cpu.rate(), COMPUTED, 0, self._cpu_done, machine, cpu.version)

    def _cpu_done(self, machine: int, version: int) -> None:
        cpu = self.cpus[machine]
        if version != cpu.version:
            return
        cpu.advance(self.now)
        done = [key for key, job in cpu.jobs.items() if job[0] <= 1e-12]
        calls = [cpu.jobs.pop(key)[1] for key in done]
        self._next(machine)
        for call in calls:
            call()

    def _transfer(
        self,
        source: int,
        target: int,
        sent: float,
        received: float,
        kind: int,
        learner: int,
        call: Callable[..., None],
        *args: Any,
    ) -> None:
        """A message sent now from host ``source`` to ``target``; ``call(*args)`` once it arrived. On one host a copy
        (no queue), between hosts once the sender's outgoing and the receiver's incoming side are both free, each
        held for the bytes it carries (``sent``, ``received``: they differ where one server stands for all). The
        transport's own cost (:meth:`Link.overhead`: RPC's serialization and copies) is CPU work where cores are
        shared: half on the sender's machine before the wire, half on the receiver's after it (as its echo measured
        it, each end on a core of its own), so that it stretches when more processes than cores are busy; without
        shared cores, time added to the arrival."""
        cluster = self.s.cluster
        link = cluster.local if source == target else cluster.link
        size = max(sent, received)
        cpu = link.overhead(size) if self.shared else 0.0

        def wire() -> None:
            if source == target:
                arrival = self.now + link.seconds(size) + link.latency
            else:
                start = max(self.now, self.out_free[source], self.in_free[target])
                self.out_free[source] = start + link.seconds(sent)
                self.in_free[target] = start + link.seconds(received)
                arrival = start + link.seconds(size) + link.latency
            if cpu:
                self._at(arrival, kind, learner, self._work, cluster.machine_of_host(target), cpu / 2, arrived, kind)
            else:
                self._at(arrival + link.overhead(size), kind, learner, call, *args)

        def arrived() -> None:
            self._at(self.now, kind, learner, call, *args)

        if cpu:
            self._work(cluster.machine_of_host(source), cpu / 2, wire, kind)
        else:
            wire()

    def _serve(self, server: int, seconds: float, then: Callable[[], None]) -> None:
        """The server's FIFO: one process, its jobs in turn (sharing its host's cores while it works)."""
        self.server_busy[server] += seconds
        queue = self.queues[server]
        queue.append((seconds, then))
        if len(queue) == 1:
            self._serve_next(server)

    def _serve_next(self, server: int) -> None:
        seconds, _ = self.queues[server][0]
        machine = self.s.cluster.machine_of_host(self.s.cluster.host_of_server(server))
        self._work(machine, seconds, lambda: self._served(server), SHARD)

    def _served(self, server: int) -> None:
        _, then = self.queues[server].popleft()
        if self.queues[server]:
            self._serve_next(server)
        then()
