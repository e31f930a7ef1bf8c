"""Node-local aggregation (the Rudra paper's Rudra-adv), as plain torch: which learners of a node sum their
gradients before one push crosses the link to a server on another host (:func:`plan_nodes`), how a node's gradients
are summed (:func:`sum_node`), and what the server checks of a node's push (:func:`check_node_push`). The shared
memory the node's learners meet in is :mod:`lightning_rudra.transport.node_board`; the learner's side
:mod:`lightning_rudra.learner.node`.

Only under hardsync: every learner pushes once per round, so a node's learners can wait for each other without
changing what the server applies (the mean over all λ gradients). Under softsync and async an update takes the first
gradients to arrive, and waiting for a node's slowest learner would change which.
"""

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class LearnerPlace:
    """What a learner says of itself when the run decides on aggregation: its node (Lightning's node rank), its
    host name, and the servers it exchanges with through RPC (those whose shared memory it did not map)."""

    rank: int
    node: int
    host: str
    remote: tuple[int, ...]


@dataclass(frozen=True)
class NodeGroup:
    """The learners of one node that aggregate their pushes to server ``server``: ``members[0]`` (the lowest rank)
    sums and pushes for all."""

    node: int
    server: int
    members: tuple[int, ...]

    @property
    def leader(self) -> int:
        return self.members[0]


def plan_nodes(places: Sequence[LearnerPlace]) -> list[NodeGroup]:
    """Every (node, server) where aggregation pays: the node's learners (one host name, at least two of them) all
    reach that server through RPC. Every learner computes the same plan from the same gathered places."""
    nodes: dict[int, list[LearnerPlace]] = {}
    for place in places:
        nodes.setdefault(place.node, []).append(place)
    groups = []
    for node, members in sorted(nodes.items()):
        if len(members) < 2 or len({m.host for m in members}) > 1:
            continue  # one learner has nothing to sum; a "node" of several host names shares no /dev/shm
        servers = set.intersection(*(set(m.remote) for m in members))
        ranks = tuple(sorted(m.rank for m in members))
        groups += [NodeGroup(node, server, ranks) for server in sorted(servers)]
    return groups


def sum_node(
    grads: Sequence[Sequence[Tensor]],
    has_grads: Sequence[Tensor],
    buffers: Sequence[Sequence[Tensor]],
    finite: Sequence[bool],
) -> tuple[list[Tensor], Tensor, list[Tensor], list[int]]:
    """The sum of the node's finite gradients (per flat buffer, in member order, into new tensors), the union of
    their ``has_grad``, the sum of their floating-point buffers (integer buffers: the first finite member's, as the
    server keeps the last of a round's), and the positions of the members left out (not finite). With no finite
    member: zeros and the first member's buffers (the server rejects such a push whole)."""
    kept = [i for i, ok in enumerate(finite) if ok]
    refused = [i for i, ok in enumerate(finite) if not ok]
    first = kept[0] if kept else 0
    total = [g.clone() if kept else torch.zeros_like(g) for g in grads[first]]
    has = has_grads[first].clone()
    summed = [b.clone() for b in buffers[first]]
    for i in kept[1:]:
        for t, g in zip(total, grads[i]):
            t.add_(g)
        has |= has_grads[i]
        for t, b in zip(summed, buffers[i]):
            if t.is_floating_point():
                t.add_(b)
    return total, has, summed, refused


def check_node_push(
    protocol: str, group: Sequence[int], refused: Sequence[int], check_learner: Callable[[int], None]
) -> None:
    """A node's push stands for the learners of ``group`` (the pusher first), each once, each active; ``refused``
    is a part of them. Only hardsync takes one."""
    if len(group) == 1 and not refused:
        return
    if protocol != "hardsync":
        raise ValueError(
            f"a node's push (learners {list(group)}) under protocol={protocol!r}: node-local aggregation is only "
            "for hardsync."
        )
    if len(set(group)) != len(group) or not set(refused) <= set(group):
        raise ValueError(f"a node's push names learners {list(group)} with refused {list(refused)}: not one each.")
    for learner in group:
        check_learner(learner)


def refusal(protocol: str, min_learners: Optional[int], simulate: Optional[int], backup: int = 0) -> Optional[str]:
    """Why node-local aggregation cannot be used with these options, or None."""
    if backup:
        return (
            f"backup={backup}: a round takes the first learners' gradients, and a node's push would bring several at "
            "once, late or not together"
        )
    if protocol != "hardsync":
        return (
            f"protocol={protocol!r}: an update there takes the first gradients to arrive, and a node's learners "
            "waiting for each other would change which (node-local aggregation is for hardsync)"
        )
    if min_learners is not None:
        return (
            f"min_learners={min_learners}: a node's push stands for all its learners, so one lost mid-round would "
            "take the node's gradients with it (elastic runs push per learner)"
        )
    if simulate:
        return f"simulate={simulate}: simulated learners share one process and one in-process server"
    return None


def wanted(  # 6 params: the options refusal reads, what the user asked, and where it would apply
    node_aggregation: Optional[bool],
    protocol: str,
    min_learners: Optional[int],
    simulate: Optional[int],
    auto: bool,
    backup: int = 0,
) -> bool:
    """Whether the learners decide on node-local aggregation at setup (every learner alike): asked for, or, by
    default, where ``auto`` (several nodes, or server nodes, of several learners each) and the run allows it
    (:func:`refusal`). Where it applies to a server is decided then: all of a node's learners must reach it through
    RPC."""
    if node_aggregation is not None:
        return node_aggregation
    return auto and not simulate and refusal(protocol, min_learners, simulate, backup) is None
