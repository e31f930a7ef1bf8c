"""A learner's part in node-local aggregation (Rudra-adv, :mod:`lightning_rudra.core.node_plan`): the learners of a node
that all reach a server on another host through RPC meet on a board in the node's shared memory
(:mod:`lightning_rudra.transport.node_board`); each round the others post their gradients there, the first (the leader)
sums them with its own and makes the node's one push, and writes the weights of the reply back for the others.

Every wait on the board is bounded: a learner waited for that ended (its process gone), stopped pushing, failed, or
showed no sign of life (its heartbeat thread stopped) for ``rpc_timeout`` ends the wait with an error that names it;
one that is only slow (a long step) is waited for, as the server waits for it in a hardsync round.
"""

import os
import socket
import threading
import time
import warnings
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Optional

from torch.futures import Future

from lightning_rudra.core.errors import LearnerLostError, ServerLostError, carried
from lightning_rudra.core.node_plan import LearnerPlace, NodeGroup, plan_nodes, sum_node
from lightning_rudra.core.update import Push, PushReply
from lightning_rudra.learner.server_client import ServerClient
from lightning_rudra.server.membership import ended
from lightning_rudra.transport.node_board import (
    BEAT,
    CLOCK,
    DONE,
    FAILED,
    FINITE,
    OPTIMIZER,
    PID,
    POSTED,
    ROUND,
    RUNNING,
    STALENESS,
    STATE,
    STATUS,
    NodeBoard,
    board_layout,
)

if TYPE_CHECKING:
    from lightning_rudra.learner.learner import Learner
    from lightning_rudra.learner.pushing import InFlight

STATUSES = ("accepted", "queued", "dropped", "rejected", "late")  # a push's, from the best to the worst
Send = Callable[[Push], Future]


class NodeMember:
    """What one learner of a :class:`NodeGroup` does each round towards the group's server: the leader gathers,
    sums and pushes (:meth:`push` returns the RPC future) and publishes the reply; another member posts its gradient
    and reads the reply (:meth:`receive`)."""

    def __init__(self, group: NodeGroup, rank: int, board: NodeBoard, timeout: float, server: str) -> None:
        self.group = group
        self.rank = rank
        self.board = board
        self.timeout = timeout
        self.server = server  # for messages: "parameter server 1"
        self.leader = rank == group.leader
        self.round = 0
        self.slot = board.slots[rank]
        self.slot.control[PID] = os.getpid()
        self.slot.control[STATE] = RUNNING
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name=f"rudra-node-{rank}", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        # a stalled process (stopped, hung in C) stops this thread too: the others see its silence
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            self.slot.control[BEAT] += 1

    def push(self, push: Push, send: Send, check: Callable[[], None]) -> Optional[Future]:
        """This learner's gradient for this round (``push``: flat, the server's part, ``finite`` said). The leader
        waits for the others', sums them and sends the node's push (``send``: the sum, as its members' push) and
        returns the future; another member posts its own and returns None.

        Args:
            push: this learner's push to the node's server, its ``finite`` a bool.
            send: sends the node's push to the server, returns the future of its reply.
            check: raises what another server's reply failed with (a learner lost there).

        Returns:
            the leader's future of the server's reply; None for another member.
        """
        assert push.grads is not None and push.finite is not None
        self.round += 1
        self.finite = push.finite
        optimizer = push.optimizer
        if not self.leader:
            slot = self.slot
            for flat, grad in zip(slot.grads[optimizer], push.grads):
                flat.copy_(grad)
            slot.has_grad[optimizer].copy_(push.has_grad)
            for flat, buffer in zip(slot.buffers, push.buffers):
                flat.copy_(buffer)
            slot.control[OPTIMIZER] = optimizer
            slot.control[FINITE] = int(push.finite)
            slot.control[POSTED] = self.round  # last: the data it announces is in place
            return None
        others = [m for m in self.group.members if m != self.rank]
        for member in others:
            control = self.board.slots[member].control
            self._wait(lambda: int(control[POSTED]) >= self.round, [member], "its gradient", check)
            if int(control[OPTIMIZER]) != optimizer:
                raise RuntimeError(
                    f"learner {member} pushed for optimizer {int(control[OPTIMIZER])} while learner {self.rank} "
                    f"pushed for optimizer {optimizer} in the same hardsync round: every learner must step its "
                    "optimizers in the same order."
                )
        slots = [self.board.slots[m] for m in others]
        total, has, summed, refused = sum_node(
            [push.grads] + [s.grads[optimizer] for s in slots],
            [push.has_grad] + [s.has_grad[optimizer].bool() for s in slots],
            [push.buffers] + [s.buffers for s in slots],
            [push.finite] + [bool(s.control[FINITE]) for s in slots],
        )
        ranks = [self.rank] + others
        refused_ranks = [ranks[i] for i in refused]
        # the sum is finite: who is not was left out of it (refused)
        return send(
            replace(push, grads=total, has_grad=has, buffers=summed, finite=True, members=others, refused=refused_ranks)
        )

    def receive(self, client: ServerClient, future: Optional[Future], check: Callable[[], None]) -> PushReply:
        """The reply for this round: the leader's from the server (its weights written to the board for the
        others), another member's from the board."""
        header = self.board.header
        if self.leader:
            assert future is not None
            reply = client.receive(future)
            assert reply.params is not None, "a server on another host sends its weights"
            for flat, value in zip(self.board.params, reply.params):
                flat.copy_(value)
            for flat, value in zip(self.board.buffers, reply.buffers or []):
                flat.copy_(value)
            header[CLOCK], header[STALENESS] = reply.clock, reply.staleness
            header[STATUS] = STATUSES.index(reply.status)
            self.board.lr_scale[0] = reply.lr_scale
            header[ROUND] = self.round  # last: the weights it announces are in place
            return reply._replace(status="rejected" if not self.finite else reply.status)
        self._wait(lambda: int(header[ROUND]) >= self.round, [self.group.leader], "the weights", check)
        client.timestamp = int(header[CLOCK])
        return PushReply(
            STATUSES[int(header[STATUS])] if self.finite else "rejected",
            int(header[STALENESS]),
            float(self.board.lr_scale[0]),
            self.board.params,
            self.board.buffers,
            int(header[CLOCK]),
        )

    def _wait(self, ready: Callable[[], bool], who: list[int], what: str, check: Callable[[], None]) -> None:
        """Until ``ready()``; fails if a learner of ``who`` is gone or silent, or ``check`` raises (another
        server's reply failed: a learner was lost there, or it gave up)."""
        pause, last_check = 0.0002, 0.0
        beats = {m: (int(self.board.slots[m].control[BEAT]), time.monotonic()) for m in who}
        while not ready():
            time.sleep(pause)
            pause = min(pause * 2, 0.002)
            now = time.monotonic()
            if now - last_check < 0.1:
                continue
            last_check = now
            try:
                check()
                for member in who:
                    beats[member] = self._check_member(member, what, beats[member], now)
            except RuntimeError:
                if ready():  # it came meanwhile: a leader writes the last round's weights, then says it is done
                    return
                raise

    def _check_member(self, member: int, what: str, beat: tuple[int, float], now: float) -> tuple[int, float]:
        control = self.board.slots[member].control
        waiting = (
            f"while learner {self.rank} waited for {what} of round {self.round} (node-local aggregation of "
            f"node {self.group.node}'s pushes to {self.server})"
        )
        state, pid = int(control[STATE]), int(control[PID])
        if state == FAILED:
            raise LearnerLostError(
                f"learner {member} (on this node, process {pid}) failed {waiting}: its own error says why."
            )
        if state == DONE:
            raise RuntimeError(
                f"learner {member} (on this node, process {pid}) stopped pushing {waiting}: under hardsync every "
                "learner pushes in every round (uneven numbers of batches or of optimizer steps?)."
            )
        if pid and ended(pid):
            raise LearnerLostError(
                f"learner {member} (on this node, process {pid}) ended {waiting}: its process died or was killed; "
                "its own output may say why."
            )
        if int(control[BEAT]) != beat[0]:
            return int(control[BEAT]), now
        if now - beat[1] > self.timeout:
            raise LearnerLostError(
                f"learner {member} (on this node, process {pid}) has shown no sign of life for more than "
                f"{self.timeout:g} s (rpc_timeout) {waiting}: its process hung or was stopped."
            )
        return beat

    def close(self, failed: bool) -> None:
        """This learner stops pushing (``failed``: because of an error): the others' waits for it end."""
        if int(self.slot.control[STATE]) == RUNNING:
            self.slot.control[STATE] = FAILED if failed else DONE
        self._stop.set()


def aggregate(
    learner: "Learner", gather: Callable[[Any], dict[int, Any]], node: int, timeout: float, announce: bool
) -> list[NodeGroup]:
    """Decide, with every learner (three collectives through ``gather``), which of this run's nodes aggregate their
    pushes to which servers, make the boards and give this learner's links to those servers their part in them. A board
    a member cannot map (another /dev/shm under the same host name) turns aggregation off for the whole run, with a
    warning (``announce``: learner 0 warns)."""
    rank = int(learner.client.rank)
    remote = tuple(link.server for link in learner.links if link.shm is None)
    places = gather(LearnerPlace(rank, node, socket.gethostname(), remote))
    groups = [g for g in plan_nodes(list(places.values())) if rank in g.members]
    boards: dict[int, NodeBoard] = {}
    try:
        errors = _make_boards(learner, gather, rank, groups, boards)
    finally:
        for board in boards.values():
            board.unlink()  # every member has mapped it, or none will (also if a collective failed)
    if errors:
        if announce:
            warnings.warn(f"lightning_rudra: node-local aggregation is off: {errors[0]}. Each learner pushes alone.")
        return []
    for group in groups:
        link = learner.links[group.server]
        server = getattr(link.client, "what", f"parameter server {link.server}")
        link.node = NodeMember(group, rank, boards[group.server], timeout, server)
    return groups


def _make_boards(
    learner: "Learner", gather: Callable[[Any], dict[int, Any]], rank: int, groups: list[NodeGroup], boards: dict
) -> list[str]:
    """The leaders make their boards, the others map them (into ``boards``); returns every learner's error."""
    error: Optional[str] = None
    try:
        for group in groups:
            if group.leader == rank:
                boards[group.server] = NodeBoard.create(_layout(learner, group))
    except OSError as why:
        error = f"learner {rank} could not make the node's shared memory: {why}"
    names = gather({server: board.names for server, board in boards.items()} if error is None else None)
    try:
        for group in groups:
            made = names[group.leader]
            if group.leader != rank and made is not None:
                boards[group.server] = NodeBoard.open(_layout(learner, group), made[group.server])
    except OSError as why:
        error = f"learner {rank} could not map the shared memory of learner {group.leader} on its node: {why}"
    return [e for e in gather(error).values() if e is not None]


def _layout(learner: "Learner", group: NodeGroup):
    link = learner.links[group.server]
    return board_layout(
        group.members,
        [layout.numels for layout in link.grad_layouts],
        [len(layout) for layout in link.grad_layouts],
        link.param_layout.numels,
        link.buffer_layout.numels,
    )


def check_in_flight(pushed: list["InFlight"]) -> None:
    """Raise what a push in flight failed with (a learner lost on that server, or the server gave up): a node's
    learners waiting for each other would otherwise never hear of it."""
    for push in pushed:
        if push.future is not None and push.future.done():
            try:
                value = push.future.value()  # raises what the call failed with
            except RuntimeError as error:  # torch's or the stream's text of it: the class the user can catch
                ours = carried(error)
                if ours is None:
                    raise
                raise ours from error
            if isinstance(value, BaseException):
                raise value
        lost = getattr(push.link.client, "_server_lost", None)
        if lost is not None:
            raise ServerLostError(lost)
