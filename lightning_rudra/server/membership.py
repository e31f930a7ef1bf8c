"""Who takes part in a run, as the server sees it: learners heard from, left, or lost, and why.

A learner is lost when its process ends before it leaves (seen at once on the server's machine), when it is
silent for longer than the timeout (a hung process, an unreachable host), or when it leaves with an error.
Without ``min_learners`` a loss ends training; with it, training goes on while at least that many are left.
No RPC, no torch: the server drives it under its lock.
"""

import os
import time
from typing import Any, Optional

from lightning_rudra.transport.elastic import incarnation_of
from lightning_rudra.core.errors import LearnerLostError

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def this_process() -> tuple[str, int]:
    """(machine, pid): the machine names one running kernel and pid namespace, so that another process with the
    same machine can tell whether this pid is alive (another container, even of the same host name, differs)."""
    try:
        with open(_BOOT_ID) as boot:
            machine = f"{boot.read().strip()}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        machine = f"unknown/{os.getpid()}"  # never equal to another process's: no liveness check by pid
    return machine, os.getpid()


def ended(pid: int) -> bool:
    """The process has exited (it may still be a zombie, waiting for its parent to collect it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:
        return False


class Membership:
    """The learners of one run. ``min_learners=None``: every learner is needed."""

    def __init__(
        self, num_learners: int, timeout: float, min_learners: Optional[int] = None, rejoin_wait: float = 0.0
    ) -> None:
        """``rejoin_wait``: seconds that lost learners have to come back, when fewer than ``min_learners`` are left,
        before training ends (0: it ends at once); set when lost learners are restarted, so that a run survives
        losing them all at once (torchrun restarting every worker)."""
        self.num_learners = num_learners
        self.timeout = timeout
        self.min_learners = min_learners
        self.rejoin_wait = rejoin_wait
        self.short_since: Optional[float] = None  # since when fewer than min_learners are left, waiting for them
        self._short = ""  # the loss that left too few
        self.machine = this_process()[0]
        self.last_heard = {learner: time.monotonic() for learner in range(num_learners)}
        self.addresses: dict[int, str] = {}  # learner -> the address it reaches the server from
        self.pids: dict[int, int] = {}  # learner -> its pid, if it runs on the server's machine
        self.left: set[int] = set()
        self.lost: dict[int, str] = {}  # learner -> why
        self.incarnations: dict[int, int] = {}  # learner -> its process now, if not the first (see LearnerId)
        self.joining: dict[int, int] = {}  # lost learner -> the incarnation of a new process asking to rejoin

    @property
    def members(self) -> set[int]:
        """The learners not lost: those that collectives, the end of training and softsync's c count."""
        return set(range(self.num_learners)) - set(self.lost)

    def all_joined(self) -> None:
        self.last_heard = {learner: time.monotonic() for learner in range(self.num_learners)}

    def heard(self, learner: int, address: str, process: Any) -> None:
        self.last_heard[learner] = time.monotonic()
        self.addresses[learner] = address
        if self._here(process):
            self.pids[learner] = int(process[1])

    def watch_process(self, learner: int, process: Any) -> None:
        """From now on ``learner``'s process is ``process`` (the one that asks to rejoin; None: not heard from
        yet), whichever process of it beat last."""
        self.pids.pop(learner, None)
        if self._here(process):
            self.pids[learner] = int(process[1])

    def _here(self, process: Any) -> bool:
        """``process``, (machine, pid), runs on this machine: its end can be seen."""
        return isinstance(process, tuple) and len(process) == 2 and process[0] == self.machine

    def where(self, learner: int) -> str:
        return f"learner {learner} (on {self.addresses.get(learner, 'a host it never named')})"

    def newly_lost(self) -> list[tuple[int, str]]:
        """Learners still counted whose process has ended, or that have been silent for too long, with why."""
        now = time.monotonic()
        found = []
        for learner in sorted(self.members - self.left):
            if learner in self.pids and ended(self.pids[learner]):
                found.append((learner, f"ended before training did: its process (pid {self.pids[learner]}) is gone"))
            elif now - self.last_heard[learner] > self.timeout:
                found.append(
                    (
                        learner,
                        f"has not been heard from for more than {self.timeout:g} s (rpc_timeout): its "
                        "process died or hung, or its host cannot be reached",
                    )
                )
        return found

    def lose(self, learner: int, why: str) -> Optional[str]:
        """Count ``learner`` as lost. Returns why training cannot go on without it, or None if it can."""
        self.lost[learner] = why
        self.pids.pop(learner, None)  # a process that takes its place names its own
        if self.min_learners is None:
            return (
                f"{self.where(learner)} {why}, and training cannot go on without it (with "
                "RudraStrategy(min_learners=k), training goes on while k learners are left)"
            )
        left = len(self.members)
        if left < self.min_learners:
            if self.rejoin_wait:
                self.short_since = self.short_since or time.monotonic()
                self._short = f"{self.where(learner)} {why}: {left} learner{'s' if left != 1 else ''} left"
                return None
            return (
                f"{self.where(learner)} {why}: {left} learner{'s' if left != 1 else ''} left, fewer than "
                f"min_learners={self.min_learners}, so training cannot go on"
            )
        return None

    def loss_told(self, learner: int, why: str) -> str:
        """What the server prints when ``learner`` is lost and training goes on."""
        then = (
            f"waiting up to {self.rejoin_wait:g} s for lost learners to come back"
            if self.short_since
            else "training goes on"
        )
        return (
            f"{self.where(learner)} was lost: it {why}. Learners left: {sorted(self.members)} "
            f"(min_learners={self.min_learners}): {then}."
        )

    @property
    def awaiting_rejoins(self) -> bool:
        """Fewer than ``min_learners`` are left, and the lost ones still have time to come back."""
        return self.short_since is not None

    def stop_awaiting(self) -> None:
        """From now on a loss that leaves too few ends training at once."""
        self.rejoin_wait, self.short_since = 0.0, None

    def rejoin_wait_over(self) -> Optional[str]:
        """Why training cannot go on, once lost learners have not come back in time; None until then."""
        if self.short_since is None or time.monotonic() - self.short_since <= self.rejoin_wait:
            return None
        self.short_since = None
        return (
            f"{self._short}, fewer than min_learners={self.min_learners}, and no lost learner came back within "
            f"{self.rejoin_wait:g} s, so training cannot go on"
        )

    def newly_failed_joins(self) -> list[int]:
        """Lost learners whose new process, waiting to rejoin, has ended or gone silent."""
        now = time.monotonic()
        return [
            learner
            for learner in sorted(self.joining)
            if (learner in self.pids and ended(self.pids[learner])) or now - self.last_heard[learner] > self.timeout
        ]

    def rejoin(self, learner: int, incarnation: int) -> None:
        """A lost learner's new process is admitted: it counts again, as ``incarnation``."""
        self.joining.pop(learner, None)
        self.lost.pop(learner, None)
        self.left.discard(learner)
        self.incarnations[learner] = incarnation
        self.last_heard[learner] = time.monotonic()
        if self.min_learners is not None and len(self.members) >= self.min_learners:
            self.short_since = None

    def all_gone(self) -> bool:
        """Every learner has left or is lost, and none is awaited back: the server's work is over."""
        return len(self.left | set(self.lost)) == self.num_learners and not self.awaiting_rejoins

    def check_index(self, learner: Any, refused: str) -> None:
        """``learner`` is one of this run's learners' indices; if not, a ValueError that begins with ``refused``
        (which call, from whom) says why."""
        if isinstance(learner, int) and not isinstance(learner, bool) and learner in range(self.num_learners):
            return
        why = "a learner is an int, not a bool (which Python counts as 0 or 1): " if isinstance(learner, bool) else ""
        raise ValueError(f"{refused}{why}this run's learners are 0..{self.num_learners - 1}")

    def check_caller(self, method: str, learner: Any) -> None:
        """A call from a learner this run does not know, or no longer counts, is refused before it changes
        anything: a lost learner's process (a stalled one that wakes up) is not merged back in; a new process for it
        may ask to rejoin (``min_learners``), and until it is admitted it may only wait, beat and leave."""
        self.check_index(learner, f"{method} from learner {learner!r} refused: ")
        incarnation = incarnation_of(learner)
        if self.joining.get(learner) == incarnation and incarnation:
            if method in ("heartbeat", "leave", "stats"):
                return
            raise RuntimeError(
                f"{method} from learner {learner} refused: it has asked to rejoin and waits to be admitted"
            )
        if learner in self.lost:
            if method in ("rejoin", "heartbeat", "leave", "stats") and incarnation > self.incarnations.get(learner, 0):
                return  # a new process for it, about to ask
            raise LearnerLostError(
                f"{method} from learner {learner} refused: it was counted as lost (it {self.lost[learner]}); a new "
                "process for it rejoins (RudraStrategy(min_learners=k, max_restarts=r)), this one cannot"
            )
        if method == "rejoin":
            raise RuntimeError(
                f"learner {learner} cannot rejoin: {self.where(learner)} is alive (pid "
                f"{self.pids.get(learner, 'unknown')}) and counted in this run; only a lost learner's place can be taken"
            )
        current = self.incarnations.get(learner, 0)
        if incarnation < current:
            raise LearnerLostError(
                f"{method} from learner {learner} refused: this process of it was counted as lost, and another one "
                "has taken its place"
            )
        if incarnation > current:
            raise RuntimeError(f"{method} from learner {learner} refused: this process has not asked to rejoin")
        if learner in self.left:
            raise RuntimeError(f"{method} from learner {learner} refused: it has left this run")
