"""Where a push's time goes (``RUDRA_TIMELINE=<directory>``): every process of a run, learners and the server
processes they start (which inherit the switch), appends one line per event of a push's path to a file of its own in
that directory, ``<seconds since the epoch> <event> <number>...``. The events, in the paper's words:

- a learner's: ``push <learner> <optimizer>`` (its step hands over its gradient), ``sent <learner> <server>`` (its
  part for a server is handed to the transport), ``reply <learner> <server>`` (the reply arrived over the push
  stream, before the learner is woken for it) and ``loaded <learner> <server>`` (its weights are in the learner's
  parameters);
- a server's: ``received <server> <learner>`` (the push reached the protocol, its gradient whole) and ``answered
  <server> <learner>`` (its reply was made: at once under async, when its round closes under hardsync).

Times from different processes compare only where they share a clock: on one machine, as the namespace hosts of the
benchmarks. ``benchmarks.profile timeline`` reads the files into a breakdown of a step. A process writes at most
``LIMIT`` lines; a directory it cannot write to warns once and turns its timeline off, never the run.
"""

import os
import socket
import threading
import time
import warnings
from typing import IO, Optional

TIMELINE = "RUDRA_TIMELINE"
LIMIT = 1_000_000  # lines per process: about 40 MB, some hours of pushes

_lock = threading.Lock()
_file: Optional[IO[str]] = None
_lines = 0
# None: not read yet; "": off (the switch unset, the file could not be opened, or the limit reached)
_directory: Optional[str] = None


def _open() -> None:
    """Called under the lock at the first event: the switch read, this process's file opened (or the timeline off)."""
    global _directory, _file
    _directory = os.environ.get(TIMELINE, "").strip()
    if not _directory:
        return
    name = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns() % 10**9}.txt"  # pids repeat across pid namespaces
    try:
        os.makedirs(_directory, exist_ok=True)
        _file = open(os.path.join(_directory, name), "a", buffering=1)
    except OSError as error:
        directory, _directory = _directory, ""  # off before the warning, which may be an error (-W error)
        _warn(f"{TIMELINE}={directory!r}: cannot write the timeline there ({error}); off.")


def _warn(message: str) -> None:
    """Warn; never raise, also where warnings are errors (``-W error``): a timeline does not end a run."""
    try:
        warnings.warn(f"lightning_rudra: {message}")
    except Exception:
        pass


def enabled() -> bool:
    """Whether this process writes a timeline (the switch read at the first call)."""
    if _directory is None:
        with _lock:
            if _directory is None:
                _open()
    return bool(_directory)


def mark(event: str, *numbers: int) -> None:
    """Append ``event`` and its ``numbers`` (which learner, server or optimizer) at the time now, if the switch is
    on."""
    global _directory, _file, _lines
    if _directory == "":
        return
    now = time.time()
    with _lock:
        if _directory is None:
            _open()
        if _file is None:
            return
        failed = None
        try:
            _file.write(" ".join([f"{now:.6f}", event, *map(str, numbers)]) + "\n")
            _lines += 1
        except OSError as error:  # a full disk ends the timeline, not the run
            failed, _lines = error, LIMIT
        if _lines >= LIMIT:
            try:
                _file.close()
            except OSError:
                pass
            _directory, _file = "", None
        if failed is not None:
            _warn(f"{TIMELINE}: writing the timeline failed ({failed}); off.")


def _reset() -> None:
    """Read the switch again at the next event, into a file of this process's own: in a forked child (whose parent's
    lock another thread may have held at the fork), and in tests."""
    global _lock, _directory, _file, _lines
    _lock = threading.Lock()
    _directory, _file, _lines = None, None, 0


os.register_at_fork(after_in_child=_reset)
