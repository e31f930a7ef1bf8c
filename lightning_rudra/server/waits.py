"""What a parameter server waits for, and on whom: for the log of the waits that last (``RUDRA_LOG_WAITS``,
:class:`~lightning_rudra.transport.logs.SlowWaits`)."""

from typing import Hashable, Iterable

from lightning_rudra.server.model_server import ModelServer


def open_waits(server: ModelServer) -> dict[Hashable, tuple[str, str]]:
    """Every wait open on ``server``, by a key that stays the same while it lasts -> (what it waits for, on whom).
    Called under its lock."""
    members = server.membership.members
    waits: dict[Hashable, tuple[str, str]] = {}
    for optimizer, waiters in server.owed.in_rounds.items():
        if waiters and server.core is not None:  # the clock moves when a round closes: a new round, a new key
            waits[("round", optimizer, server.core.clock)] = (
                f"the {server.core.config.protocol} round of optimizer {optimizer}"
                + (" (replies paced)" if server.owed.pacing is not None else ""),
                learners(server.core.awaited(optimizer)),
            )
    if server.owed.held and server.core is not None:  # on_stale='block': the clock moves as they go
        waits[("held", server.core.clock)] = (
            f"the pushes of {learners(server.owed.held)} held back (on_stale='block')",
            "the learners whose older gradients would otherwise go staler than max_staleness",
        )
    for sequence, (_, arrived) in server.gatherings.open.items():
        waits[("collective", sequence)] = (f"collective {sequence}", learners(members - set(arrived)))
    if server.finish_waiters:
        waits[("finish",)] = ("the end of training", learners(members - server.finished))
    attaching = server.attaching & members
    if attaching and not server.registered.done():
        waits[("model",)] = (f"the model, for {learners(attaching)} to pull", "learner 0, which registers it")
    for learner in server.rejoins.requests:
        waits[("rejoin", learner)] = (
            f"an epoch's start, to admit learner {learner}'s new process",
            f"{learners(members)}, which must all start it",
        )
    return waits


def learners(which: Iterable[int]) -> str:
    ordered = sorted(which)
    return f"learner {ordered[0]}" if len(ordered) == 1 else f"learners {ordered}"
