"""Lost learners that come back (``min_learners``): a new process for a lost learner asks to rejoin, and is admitted
where it can take part without anyone waiting for what it missed: at the start of an epoch, once every learner
training has started that epoch. There it takes the run's epoch, global step and count of collectives, which every
learner reports as it starts an epoch (:meth:`RejoinAdmissions.report`). No RPC: the server drives it under its lock.
"""

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

from lightning_rudra.core.optimizers import hyperparameters
from lightning_rudra.core.protocol import Server
from lightning_rudra.server.membership import Membership


@dataclass
class Admission:
    """Where a rejoining learner starts: the epoch the others have just started, the furthest global step among
    them, how many collectives each has made (the next one is the first it takes part in), and, at its admission,
    the seconds since the run's first epoch started (``max_time`` counts them)."""

    epoch: int
    global_step: int
    collectives: int
    elapsed: float = field(default=0.0, compare=False)


@dataclass
class _Request:
    reply: Any  # the future the rejoining process waits on
    incarnation: int
    after: int  # the newest epoch any learner had started when it asked: it starts in a later one


def describe_module(parameters: list[tuple[str, tuple[int, ...]]], optimizers: list[str]) -> dict[str, Any]:
    """What a process that rejoins must share with the run: its parameters' names and shapes, its optimizers'
    classes."""
    return {"parameters": [[name, list(shape)] for name, shape in parameters], "optimizers": list(optimizers)}


def _differences(run: dict[str, Any], new: dict[str, Any]) -> list[str]:
    ours, theirs = dict((n, tuple(s)) for n, s in run["parameters"]), dict((n, tuple(s)) for n, s in new["parameters"])
    found = [f"parameter {name!r} is missing" for name in ours if name not in theirs]
    found += [f"parameter {name!r} is not in the run's module" for name in theirs if name not in ours]
    found += [
        f"parameter {name!r} has shape {theirs[name]}, the run's {shape}"
        for name, shape in ours.items()
        if name in theirs and theirs[name] != shape
    ]
    if run["optimizers"] != new["optimizers"]:
        found.append(f"its optimizers are {new['optimizers']}, the run's {run['optimizers']}")
    return found


class RejoinAdmissions:
    """The server's side of rejoining: the requests to rejoin it admits or refuses, and what every learner reported at
    the start of its latest epoch, for the learners of ``membership``."""

    def __init__(self, membership: Membership, announce: Callable[[str], None]) -> None:
        self.membership = membership
        self.announce = announce  # says that a learner rejoined, once the server's lock is released
        self.module: Optional[dict[str, Any]] = None  # learner 0's describe_module, from its register
        self.progress: dict[int, Admission] = {}  # learner -> at the start of its latest epoch
        self.furthest = Admission(0, 0, 0)  # the latest epoch start any learner reported, even one lost since
        self.started: Optional[float] = None  # when the first epoch start was reported
        self.requests: dict[int, _Request] = {}

    def check(self, learner: int, module: dict[str, Any]) -> None:
        """Refuses a process whose module or optimizers differ from the run's, saying how."""
        if self.module is None:
            raise RuntimeError(f"learner {learner} cannot rejoin yet: learner 0 has not registered the model")
        found = _differences(self.module, module)
        if found:
            raise ValueError(
                f"learner {learner} cannot rejoin: its module differs from the one this run trains: "
                f"{'; '.join(found[:5])}{' ...' if len(found) > 5 else ''}. Start it with the same code and arguments."
            )

    def ask(self, learner: int, incarnation: int, reply: Any) -> None:
        if learner in self.requests:
            raise RuntimeError(
                f"learner {learner} cannot rejoin: another new process for it is already waiting to be admitted"
            )
        newest = max((p.epoch for p in self.progress.values()), default=-1)
        self.requests[learner] = _Request(reply, incarnation, newest)
        self.membership.joining[learner] = incarnation
        self.membership.last_heard[learner] = time.monotonic()

    def report(self, learner: int, epoch: int, global_step: int, collectives: int) -> None:
        self.started = self.started or time.monotonic()
        self.progress[learner] = Admission(epoch, global_step, collectives)
        if (epoch, global_step) >= (self.furthest.epoch, self.furthest.global_step):
            self.furthest = self.progress[learner]

    def admit(self, core: Server) -> list[tuple[Any, Any]]:
        """Admits the learners whose epoch has come: from here on they count, in the membership, the protocol and
        the statistics. Their replies, to settle: ``(Admission, hyper-parameters per optimizer and group)``."""
        admitted = []
        for learner, request, where in self._due(self.membership.members):
            self.membership.rejoin(learner, request.incarnation)
            core.add(learner)
            core.stats.lost.pop(learner, None)
            core.stats.record(learner, "rejoined", f"a new process, admitted at the start of epoch {where.epoch}")
            hparams = [[hyperparameters(group) for group in opt.param_groups] for opt in core.optimizers]
            admitted.append((request.reply, (where, hparams)))
            self.announce(
                f"{self.membership.where(learner)} rejoined at the start of epoch {where.epoch}; training goes on "
                f"with learners {sorted(self.membership.members)}."
            )
        return admitted

    def _due(self, members: set[int]) -> list[tuple[int, _Request, Admission]]:
        """The requests to admit now: every member has started the same epoch, later than when the request came; or,
        with no member left (all lost, awaited back), at once, at the start of the latest epoch any learner started
        (what the lost ones held of it is dealt again). Removed from the waiting ones."""
        if not self.requests:
            return []
        if members:
            reports = [self.progress.get(m) for m in members]
            if any(r is None for r in reports) or len({r.epoch for r in reports if r is not None}) != 1:
                return []
            started = [r for r in reports if r is not None]
            where = Admission(
                started[0].epoch, max(r.global_step for r in started), max(r.collectives for r in started)
            )
            due = [(learner, request) for learner, request in self.requests.items() if where.epoch > request.after]
        else:
            where, due = replace(self.furthest), list(self.requests.items())
        where.elapsed = time.monotonic() - self.started if self.started is not None else 0.0
        for learner, _ in due:
            del self.requests[learner]
            self.progress[learner] = where
        return [(learner, request, where) for learner, request in due]

    def fail(self, learner: int, why: str) -> list[tuple[Any, Any]]:
        """The process waiting to rejoin as ``learner`` is gone: its reply fails, if it still waited for one."""
        self.membership.joining.pop(learner, None)
        self.progress.pop(learner, None)
        request = self.requests.pop(learner, None)
        return [] if request is None else [(request.reply, RuntimeError(f"learner {learner} could not rejoin: {why}"))]

    def stop(self, why: str) -> list[tuple[Any, Any]]:
        """Training cannot go on (``why``): the processes waiting to rejoin are told so, and why."""
        replies = [
            (request.reply, RuntimeError(f"learner {learner} could not rejoin: training stopped: {why}"))
            for learner, request in self.requests.items()
        ]
        for learner in self.requests:
            self.membership.joining.pop(learner, None)
        self.requests = {}
        return replies

    def tell_training_over(self) -> list[tuple[Any, Any]]:
        """Training is over: the processes waiting to rejoin are told so (None); they only leave."""
        for learner in self.requests:
            self.membership.joining.pop(learner, None)
        replies = [(request.reply, None) for request in self.requests.values()]
        self.requests = {}
        return replies
