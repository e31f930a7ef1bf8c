"""Launching learners so that training survives a lost one (``RudraStrategy(min_learners=k)``).

Lightning's launchers end every learner as soon as one fails (its popen launcher's observer SIGKILLs them all;
torch's process join for spawn terminates them), which is DDP's only choice. A parameter server's learners do not
need each other: the server decides whether training can go on (:mod:`lightning_rudra.server.membership`). Here a
learner that ends is reported with its exit code or signal, the others train on, and once training is over a lost
learner still running (a stalled process that woke up too late) is ended. With ``max_restarts``, a lost learner's
process is started again (:class:`Restarts`), and rejoins the run. The servers outlive the learners that started
them, so under spawn and forkserver learner 0 can be lost and restarted too; under popen learner 0's process is the
user's script, which started the others: if it is lost, the others finish training, but nothing restarts it.
"""

import multiprocessing.connection
import os
import pickle
import signal
import subprocess
import threading
import time
import warnings
from typing import Any, Callable, Optional

from lightning_fabric.utilities.distributed import _set_num_threads_if_needed
from pytorch_lightning.strategies.launchers import _SubprocessScriptLauncher

from lightning_rudra.core.errors import LearnerLostError, RudraError
from lightning_rudra.server.membership import this_process
from lightning_rudra.transport.rpc_world import real_stderr


def describe_exit(code: int) -> str:
    """A process's exit status in words: ``exit code 7`` or ``signal SIGKILL``."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def warn_lost(rank: int, code: int, min_learners: int, trace: str = "", then: str = "") -> None:
    error = f" Its error:\n{trace}" if trace else ""
    warnings.warn(
        f"lightning_rudra: learner {rank}'s process ended with {describe_exit(code)} (min_learners="
        f"{min_learners}: training goes on while that many learners are left; the batches it held are dealt to the "
        f"others).{then}{error}",
        stacklevel=1,
    )


class Restarts:
    """Which lost learners to start again (``max_restarts`` per learner), and when: after 1 s, then twice as long
    each time, at most 10 s. Once training is over (:attr:`closed`), none."""

    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = max_restarts
        self.counts: dict[int, int] = {}  # learner -> restarts so far
        self.due: dict[int, float] = {}  # learner -> when to start it again
        self.closed = False

    def lost(self, rank: int) -> str:
        """Learner ``rank``'s process ended badly: schedule its restart if it has restarts left. Says what
        follows, for the warning."""
        count = self.counts.get(rank, 0)
        if self.closed or not self.max_restarts:
            return ""
        if count >= self.max_restarts:
            return f" It was restarted {count} time(s) already (max_restarts={self.max_restarts}): not again."
        self.counts[rank] = count + 1
        delay = min(10.0, 2.0**count)
        self.due[rank] = time.monotonic() + delay
        return f" Restarting it in {delay:g} s (restart {count + 1} of {self.max_restarts}); it rejoins the run."

    def now(self) -> list[int]:
        """The learners to start again now."""
        if self.closed:
            self.due = {}
        ready = [rank for rank, when in self.due.items() if time.monotonic() >= when]
        for rank in ready:
            del self.due[rank]
        return ready


def _trace(error_file: str) -> str:
    """What torch's spawned process wrote about its exception, if it raised one."""
    try:
        with open(error_file, "rb") as file:
            return str(pickle.load(file)).rstrip()
    except (OSError, pickle.UnpicklingError, EOFError):
        return ""


class PopenLauncher(_SubprocessScriptLauncher):
    """Lightning's popen launcher (the script re-run per learner), whose observer reports a lost child instead of
    ending every learner."""

    def __init__(
        self,
        *args: Any,
        min_learners: int,
        report: Callable[[int, str, tuple[str, int]], None],
        max_restarts: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.min_learners = min_learners
        # tells the server (rank, why, (machine, pid)): on another machine it would only see silence
        self.report = report
        self.restarts = Restarts(max_restarts)
        self._reported: set[int] = set()  # children whose end was reported, or that were ended here

    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            threading.Thread(target=self._observe, daemon=True, name="rudra-learner-observer").start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)

    @property
    def _first_rank(self) -> int:
        """The global rank of this node's first child (its local rank 1)."""
        return self.cluster_environment.node_rank() * self.num_processes + 1

    def _observe(self) -> None:
        while len(self._reported) < len(self.procs) or self.restarts.due:
            for index, proc in enumerate(self.procs):
                if index not in self._reported and proc.poll() is not None:
                    self._reported.add(index)
                    if proc.returncode == 0:  # training is over: none is restarted
                        self.restarts.closed = True
                    else:
                        rank = self._first_rank + index
                        # before a restart asks to rejoin; naming the process, so that a late report is not taken
                        # for one about the process that replaced it
                        self.report(rank, describe_exit(proc.returncode), (this_process()[0], proc.pid))
                        warn_lost(rank, proc.returncode, self.min_learners, then=self.restarts.lost(rank))
            for rank in self.restarts.now():
                self._restart(rank - self._first_rank)
            time.sleep(0.2 if self.restarts.due else 1.0)

    def _restart(self, index: int) -> None:
        """The same command and environment as Lightning's launcher gave this child (its local rank)."""
        env = {**os.environ, "LOCAL_RANK": str(index + 1)}
        with real_stderr():  # not the filter of a leave under way in this process
            self.procs[index] = subprocess.Popen(self.procs[index].args, env=env)
        self._reported.discard(index)

    def end_lost(self, lost: list[int]) -> None:
        """Training is over: end this node's learners that the server counted as lost and still run."""
        self.restarts.closed = True
        for rank in lost:
            index = rank - self._first_rank
            if 0 <= index < len(self.procs) and self.procs[index].poll() is None:
                self._reported.add(index)
                self.procs[index].kill()
                self.procs[index].wait()


def join_survivors(
    context: Any,
    min_learners: int,
    stats_ready: Callable[[], Optional[list[int]]],
    grace: float,
    restarts: Restarts,
    restart: Callable[[int], None],
) -> None:
    """``torch.multiprocessing``'s ``ProcessContext.join`` until every process has ended, except that a learner
    that fails (learner 0 too: the servers outlive it) is reported and the others go on; one with restarts left is
    started again (``restart``). Once a learner has ended well, training is over: none is restarted. Once learner 0
    has ended well, ``stats_ready()`` names the learners the server lost; those still running are ended, and so is
    any learner still running ``grace`` seconds after the first ended well (one lost after learner 0 took the
    statistics, or any if learner 0 was lost). Then :func:`check_learner_zero`."""
    ended: Optional[set[int]] = None  # the learners ended here, once one has ended well
    asked = False  # for the learners the server lost
    deadline = float("inf")
    while context.sentinels or restarts.due:
        _reap(context, min_learners, restarts, ended or set())
        for index in restarts.now():
            restart(index)
        if ended is None and restarts.closed:
            ended, deadline = set(), time.monotonic() + grace
        if ended is None:
            continue
        if not asked and context.processes[0].exitcode == 0:
            asked = True
            ended |= {rank for rank in stats_ready() or [] if context.processes[rank].is_alive()}
        if time.monotonic() > deadline:
            ended |= _still_running(context, grace)
            deadline = float("inf")
        for rank in ended:
            if context.processes[rank].is_alive():
                context.processes[rank].kill()


def _reap(context: Any, min_learners: int, restarts: Restarts, ended: set[int]) -> None:
    """The learners' processes that end now (waited for up to a second): one that failed, unless ended here, is
    reported lost; one that ended well closes the restarts (training is over)."""
    ready = multiprocessing.connection.wait(list(context.sentinels), timeout=0.2 if restarts.due else 1.0)
    for sentinel in ready:
        index = context.sentinels[sentinel]
        process = context.processes[index]
        process.join()
        del context.sentinels[sentinel]
        if process.exitcode == 0:
            restarts.closed = True
        elif index not in ended:
            then = restarts.lost(index)
            warn_lost(index, process.exitcode, min_learners, _trace(context.error_files[index]), then)


def _still_running(context: Any, grace: float) -> set[int]:
    """The learners still running ``grace`` seconds after training ended, with a warning: to be ended."""
    late = {rank for rank in context.sentinels.values() if context.processes[rank].is_alive()}
    warnings.warn(
        f"lightning_rudra: learners {sorted(late)} were still running {grace:g} s after training ended: ended.",
        stacklevel=1,
    )
    return late


def check_learner_zero(context: Any, restarts: Restarts, raised: Optional[type[RudraError]] = None) -> None:
    """After :func:`join_survivors`: raises if learner 0's last process did not end well, as only it brings the
    results back; where no learner finished training, with the class of the package's error learner 0 ``raised``
    (a lost server, a refused option), if it raised one."""
    code = context.processes[0].exitcode
    if code != 0:
        trace = _trace(context.error_files[0])
        error = f"\n\n-- learner 0's error:\n{trace}" if trace else ""
        if not restarts.closed:  # no learner finished training: learner 0's error is the run's
            raise (raised or LearnerLostError)(f"learner 0's process ended with {describe_exit(code)}.{error}")
        raise LearnerLostError(
            f"learner 0's process ended with {describe_exit(code)} and was not restarted (max_restarts="
            f"{restarts.max_restarts}): the other learners trained to the end, but only learner 0 brings the trained "
            "weights and the results back to this process, so they are lost. Set max_restarts so that learner 0 "
            f"comes back, or save what you need from the module in every learner.{error}"
        )
