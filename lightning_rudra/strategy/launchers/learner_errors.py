"""What a learner process's failure becomes in the process that called ``fit`` under ``spawn`` and ``forkserver``.

torch's process join raises a ``ProcessExitedException`` for a learner that died without a Python error (killed)
and a ``ProcessRaisedException``, holding only the text of the traceback, for one that raised. A learner killed is
a learner lost: :class:`LearnerExitedError` is both. A learner that raised one of the package's errors
(:mod:`lightning_rudra.core.errors`) records its class in a folder the launcher makes, and the calling process
raises that class, with torch's message and torch's exception as its cause."""

import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Iterator, Optional

from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from lightning_rudra.core.errors import BY_NAME, LearnerLostError, RudraError


class LearnerExitedError(LearnerLostError, ProcessExitedException):
    """A learner's process ended without a Python error (a signal, ``os._exit``): a lost learner, and still the
    ``ProcessExitedException`` torch raised, with its message and fields."""

    __init__ = ProcessExitedException.__init__  # RuntimeError's comes first in the bases' order


def record(folder: Optional[str], process: int, error: BaseException) -> None:
    """In learner ``process``: the class of ``error``, if the calling process can raise it (:func:`kept`)."""
    ours = next((kind.__name__ for kind in type(error).__mro__ if kind in BY_NAME.values()), None)
    if folder is not None and ours is not None:
        try:
            with open(os.path.join(folder, str(process)), "w") as file:
                file.write(ours)
        except OSError:  # the folder is gone (the launcher ended first): the learner's own error matters, not this
            pass


def recorded(folder: str, process: int) -> Optional[type[RudraError]]:
    try:
        with open(os.path.join(folder, str(process))) as file:
            return BY_NAME.get(file.read())
    except OSError:
        return None


def forget(folder: Optional[str], process: int) -> None:
    """Before learner ``process`` starts again: its last process's error is not its next one's."""
    if folder is not None:
        try:
            os.remove(os.path.join(folder, str(process)))
        except FileNotFoundError:
            pass


def errors_folder() -> str:
    """Where the learners of one launch :func:`record` their errors' classes (removed by :func:`kept`)."""
    return tempfile.mkdtemp(prefix="rudra-errors-")


@contextmanager
def kept(folder: Optional[str]) -> Iterator[None]:
    """Around torch's join of the learners: their failure raised as the package's error where there is one;
    ``folder`` (:func:`errors_folder`) is removed when it ends."""
    try:
        yield
    except ProcessExitedException as exited:
        raise LearnerExitedError(
            exited.msg, exited.error_index, exited.error_pid, exited.exit_code, exited.signal_name
        ) from exited
    except ProcessRaisedException as raised:
        error = recorded(folder, raised.error_index) if folder is not None else None
        if error is None:
            raise
        raise error(str(raised)) from raised
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
