"""The errors a user can catch around ``trainer.fit``: every one is a :class:`RudraError` and still the built-in
it was before the package had its own (a loss a :class:`RuntimeError`, a refusal a :class:`ValueError`), so code
that catches those goes on catching them. Where each reaches the calling process, and where it cannot:
``docs/faults.md``.

In the lowest layer, so that every layer raises them; the learner's side brings their class back across RPC and the
stream (:func:`carried`), which hand over only a name and a message."""

import re
from typing import Optional


class RudraError(Exception):
    """Base class of the errors lightning_rudra raises on purpose."""


class LearnerLostError(RudraError, RuntimeError):
    """A learner was lost (its process ended or went silent past ``rpc_timeout``, or it stopped with an error) and
    training cannot go on without it: no ``min_learners``, or fewer than that left."""


class ServerLostError(RudraError, RuntimeError):
    """A parameter server is gone: its process died, or it did not answer within ``rpc_timeout``."""


class ConfigurationError(RudraError, ValueError):
    """An option, or what the Trainer, the module or its dataloaders ask for, is refused before training: the
    message names the value, why, and what to use instead."""


# the classes that cross to another process by their name
BY_NAME: dict[str, type[RudraError]] = {e.__name__: e for e in (LearnerLostError, ServerLostError, ConfigurationError)}
# torch RPC re-raises an exception raised by a remote function as a RuntimeError whose message starts with the
# class's name (`_run_function` in torch/distributed/rpc/internal.py); a future's callback that raised, likewise
_NAMED = re.compile(r"(?:Got the following error when running the callback: )?(%s): " % "|".join(BY_NAME))


def carried(error: BaseException) -> Optional[RudraError]:
    """The error of this package that ``error`` carries from another process, with the message the caller gets
    today; None if it carries none.

    Args:
        error: a RuntimeError made by torch from an exception raised in another process or in a future's
            callback (its message starts with the class's name), or a
            :class:`~lightning_rudra.transport.stream.ServerError` (its ``kind``: the name of the class).
    """
    kind = getattr(error, "kind", None)
    if kind in BY_NAME:
        return BY_NAME[kind](str(error))
    found = _NAMED.match(str(error))
    return BY_NAME[found.group(1)](str(error)) if found else None
