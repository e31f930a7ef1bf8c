"""What lightning_rudra's processes log, and where. Every module logs to its own named logger
(``logging.getLogger(__name__)``, under ``lightning_rudra``), as Lightning does; learners add no handler (their
records reach whatever logging the user's script configured, and warnings reach stderr without any). A server
process has no script of its own: :func:`log_to_stderr` gives it one handler, on its stderr. Two switches, read from
the environment, which server processes inherit from the learner that starts them:

- ``RUDRA_LOG_WAITS=<seconds>``: every wait longer than that (a learner's on its server, a server's on its learners)
  logs, as a warning, what it waits for and on whom, and again each time it has waited as long again
  (:class:`SlowWaits`);
- ``RUDRA_LOG_LEVEL=DEBUG``: a server process also logs joins, registrations, refusals and leaves (default ``INFO``:
  losses and rejoins, what it printed before).
"""

import atexit
import logging
import os
import queue
import sys
import time
from logging.handlers import QueueHandler, QueueListener
from typing import Callable, Hashable, Optional, TextIO

WAITS = "RUDRA_LOG_WAITS"
LEVEL = "RUDRA_LOG_LEVEL"
_QUEUED = 10_000  # records waiting to be written: past that, a stderr nobody reads loses records, not memory
_DRAINS: list[Callable[[float], None]] = []  # log_to_stderr's, for drain_records


def waits_after() -> Optional[float]:
    """``RUDRA_LOG_WAITS`` in seconds; None when it is not set (waits are not logged)."""
    value = os.environ.get(WAITS, "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(
            f"{WAITS}={value!r} is not a number of seconds: expected a positive number, e.g. {WAITS}=10 to log every "
            "wait longer than 10 s, or unset it"
        )
    return seconds


def log_level() -> int:
    """``RUDRA_LOG_LEVEL``: the level of a server process's records on its stderr (default ``INFO``)."""
    name = os.environ.get(LEVEL, "INFO").strip().upper()
    level = logging.getLevelName(name)
    if not isinstance(level, int):
        raise ValueError(f"{LEVEL}={name!r} is not a logging level: expected DEBUG, INFO, WARNING or ERROR")
    return level


def check_switches() -> None:
    """Refuses a bad value of either switch in the learner that starts a server, where the error reaches the user,
    rather than in the server process."""
    waits_after()
    log_level()


class _Dropping(QueueHandler):
    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:  # the writer is stuck on a stderr nobody reads
            pass


def log_to_stderr(stream: Optional[TextIO] = None) -> Callable[[float], None]:
    """A server process's records on its stderr (``stream``), as ``lightning_rudra: <message>``, at ``INFO`` or at
    ``RUDRA_LOG_LEVEL``. They are written by a thread of their own: the thread that logs (an RPC handler, the
    watch for lost learners) never waits for, nor fails with, a stderr that is closed or that nobody reads (a
    record it cannot write is dropped: logging's ``handleError``). Returns what waits, at most the seconds it is
    given, for the records logged so far to be written (also run at exit)."""
    level = log_level()
    writer = logging.StreamHandler(stream or sys.stderr)
    writer.setFormatter(logging.Formatter("lightning_rudra: %(message)s"))
    records: "queue.Queue[logging.LogRecord]" = queue.Queue(_QUEUED)
    listener = QueueListener(records, writer)
    listener.start()
    package = logging.getLogger(__name__.split(".")[0])
    package.addHandler(_Dropping(records))
    package.setLevel(level)
    package.propagate = False  # a server process's root logger is nobody's

    def drain(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while records.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    atexit.register(drain, 2.0)
    _DRAINS.append(drain)
    return drain


def drain_records(seconds: float) -> None:
    """What :func:`log_to_stderr`'s exit does, for a process that ends with ``os._exit`` (a server forked by the
    server starter): waits, at most ``seconds``, for the records logged so far to be written."""
    for drain in _DRAINS:
        drain(seconds)


class SlowWaits:
    """The waits of one place (``who``: "learner 1", "parameter server 0"), checked now and then with
    :meth:`check`: a wait first seen then that lasts longer than ``RUDRA_LOG_WAITS`` seconds is logged as a warning
    on ``logger``, saying what it waits for and on whom, and again each time it has waited as long again. Costs
    nothing when the switch is off."""

    def __init__(self, logger: logging.Logger, who: str, after: Optional[float]) -> None:
        """``after``: :func:`waits_after`, read once by the caller."""
        self.logger = logger
        self.who = who
        self.after = after
        self._since: dict[Hashable, tuple[float, float]] = {}  # wait -> (when first seen, when next logged)

    @property
    def on(self) -> bool:
        return self.after is not None

    def check(self, waits: dict[Hashable, tuple[str, str]]) -> None:
        """``waits``: every wait open now, by a key that stays the same while it lasts -> (what it waits for, on
        whom). Those no longer open are forgotten."""
        if self.after is None:
            return
        now = time.monotonic()
        self._since = {key: self._since.get(key, (now, now + self.after)) for key in waits}
        for key, (what, whom) in waits.items():
            since, due = self._since[key]
            if now >= due:
                self._since[key] = (since, now + self.after)
                self.logger.warning("%s has waited %.0f s for %s, on %s", self.who, now - since, what, whom)
