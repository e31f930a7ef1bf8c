"""How a learner's step pushes (the base of :class:`~lightning_rudra.learner.learner.Learner`, which owns the
state it reads): the gradient cut into each server's part, packed into shared memory, compressed, summed with its
node's (node-local aggregation) or ended as a call in pieces (buckets); the pushes in flight, and their replies
received and loaded."""

from dataclasses import replace
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
from torch import Tensor
from torch.futures import Future
from torch.optim import Optimizer

from lightning_rudra.core.clipping import Clipping, across_servers
from lightning_rudra.core.compression import ErrorFeedback
from lightning_rudra.core.lookahead import StepAhead
from lightning_rudra.core.optimizers import hyperparameters
from lightning_rudra.core.push_checks import all_finite
from lightning_rudra.core.shards import parts
from lightning_rudra.core.update import Push, PushReply
from lightning_rudra.learner.buckets import Bucketing
from lightning_rudra.learner.client import LearnerClient
from lightning_rudra.learner.link import ServerLink
from lightning_rudra.learner.node import STATUSES, check_in_flight
from lightning_rudra.learner.server_client import ServerClient
from lightning_rudra.transport.stream_pieces import PiecedCall
from lightning_rudra.transport import timeline

CPU = torch.device("cpu")


class InFlight(NamedTuple):
    """A push to one server not yet settled: through which link, its reply's future (None: a node member's, read
    from the board), the buffers it carried, and its reply once received and loaded."""

    link: ServerLink
    future: Optional[Future]
    buffers: list[Tensor]
    reply: Optional[PushReply] = None


class Pushes(NamedTuple):
    """The pushes of one step in flight, one per server, and their optimizer."""

    pushed: list[InFlight]
    optimizer: int


def _dense(params: list[Tensor]) -> list[Tensor]:
    """The parameters' gradients, zeros for none; sparse ones (nn.Embedding(sparse=True)) travel dense: the server's
    flat buffers are dense."""
    return [
        torch.zeros_like(p) if p.grad is None else p.grad.to_dense() if p.grad.is_sparse else p.grad for p in params
    ]


def _unordered(link: ServerLink) -> bool:
    """Whether ``link``'s server may run a learner's pushes in another order than it sent them: pushes through RPC,
    whose calls run on a pool of threads (the push stream runs them in order, a node's leader waits for each
    round)."""
    return isinstance(link.client, LearnerClient) and link.client.stream is None and link.node is None


def _whose(client: ServerClient) -> int:
    """The learner whose step pushes through ``client``: simulated learners share one client (it says whose step
    runs now)."""
    return getattr(client, "learner", client.rank)


class Pushing:
    """The push's half of :class:`~lightning_rudra.learner.learner.Learner`: the state it reads is the learner's, set
    by its constructor."""

    clients: list[ServerClient]
    links: list[ServerLink]
    optimizer_params: list[list[Tensor]]
    grad_timestamps: list[Optional[tuple[int, ...]]]
    overlap: bool
    feedback: Optional[ErrorFeedback]
    bucketing: Optional[Bucketing]
    sends_norm: bool
    on_push: Optional[Callable[[int, str, int, float], None]]
    step_ahead: Optional[StepAhead]
    _in_flight: Optional[Pushes]

    def _timestamps(self) -> tuple[int, ...]:
        return tuple(client.timestamp for client in self.clients)

    def _push(self, index: int, optimizer: Optimizer, clipping: Sequence[Clipping]) -> None:
        timeline.mark("push", _whose(self.clients[0]), index)
        params = self.optimizer_params[index]
        grads = _dense(params)
        # one decision for the whole gradient: each server would otherwise refuse or apply its part alone
        finite = None if len(self.links) == 1 else all_finite(grads)
        # overlap with dana: the learner's own step while its push is in flight, unless the server clips or refuses it
        ahead = self.step_ahead if self.overlap and not clipping else None
        holders = [link.server for link in self.links if link.owned[index]]
        # the norm where an update applies this gradient alone; none for a gradient the servers refuse (not finite)
        clipping = across_servers(clipping, holders, grads, index, norm=self.sends_norm and finite is not False)
        has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.bool)
        timestamps = self._gradient_timestamps(index)
        hparams = [hyperparameters(g) for g in optimizer.param_groups]
        all_buffers = self._packed_buffers()
        if any(map(_unordered, self.links)):
            # the reply in flight first: RPC may run this push on the server before the last one, whose older
            # buffers (BatchNorm's statistics, a count) would then replace this one's
            self.wait_for_replies()
        pushed: list[InFlight] = []
        for link in self._push_order():
            owned = link.owned[index]
            positions = [position for position, _ in owned]
            pieces = self.bucketing.end(link, index) if self.bucketing is not None else None
            # the pieces that went during the backward pass hold this part: none to pack
            packed = None if pieces and pieces[1] else self._packed(link, index, parts(grads, owned))
            stamp, buffers = timestamps[link.server], all_buffers[link.server]
            push = Push(
                _whose(link.client),
                index,
                packed,
                has_grad[positions],
                stamp,
                hparams,
                buffers,
                finite,
                clipping=clipping,
            )
            timeline.mark("sent", push.learner, link.server)
            pushed.append(InFlight(link, self._send(link, push, pushed, pieces and pieces[0]), buffers))
            if pieces:
                assert self.bucketing is not None
                self.bucketing.pushed(link)
        self.wait_for_replies()
        self._in_flight = Pushes(pushed, index)
        if not self.overlap:
            self.wait_for_replies()
        elif ahead is not None and (all_finite(grads) if finite is None else finite):
            ahead.step(index, optimizer, {id(p): g for p, g in zip(params, grads) if p.grad is not None})

    def _gradient_timestamps(self, index: int) -> tuple[int, ...]:
        """The timestamps (one per server) of the weights the gradient of optimizer ``index`` came from (no hook saw
        it: a gradient set by hand, from the current ones); the next gradient starts afresh."""
        timestamps = self.grad_timestamps[index] or self._timestamps()
        self.grad_timestamps[index] = None
        return timestamps

    def _packed_buffers(self) -> list[list[Tensor]]:
        """Each server's part of the buffers, flat: packed before the reply in flight is loaded (its buffers predate
        this step's forward), then that reply settled if a server may still read a shared-memory gradient buffer for
        it."""
        buffers = [link.buffer_layout.pack(link.buffers, CPU) for link in self.links]
        self._settle_shared_memory()
        return buffers

    def _settle_shared_memory(self) -> None:
        """Receive and load the replies in flight of the servers that may still read this learner's shared-memory
        gradient buffer, before the next gradient is packed into it (loaded now, as the weights after the update the
        reply answers: later, the server may have applied the next push). The others stay in flight (with
        ``overlap``, the next push to another host goes out while the reply to the last comes back); with node-local
        aggregation too, every reply is settled, as the node's board needs."""
        if self._in_flight is None or not any(link.shm is not None for link in self.links):
            return
        if any(link.node is not None for link in self.links):
            self.wait_for_replies()
            return
        in_flight, self._in_flight = self._in_flight, None  # a reply that fails is not waited for again
        pushed = in_flight.pushed
        self._in_flight = in_flight._replace(
            pushed=[p._replace(reply=self._load(p, pushed)) if p.link.shm is not None else p for p in pushed]
        )

    def _load(self, p: InFlight, pushed: list[InFlight]) -> PushReply:
        """The reply to ``p``, received and its weights loaded, once."""
        if p.reply is not None:
            return p.reply
        reply = self._receive(p.link, p.future, pushed)
        p.link.load_reply(reply.params, reply.buffers, p.buffers if self.overlap else None)
        timeline.mark("loaded", _whose(p.link.client), p.link.server)
        return reply

    def _push_order(self) -> list[ServerLink]:
        """A node's leader waits for its members' gradients (node-local aggregation): the other pushes go first."""
        return sorted(self.links, key=lambda link: link.node is not None)

    def _send(
        self, link: ServerLink, push: Push, pushed: list[InFlight], pieces: Optional[PiecedCall] = None
    ) -> Optional[Future]:
        """Send ``push`` to ``link``'s server, alone (as the end of ``pieces``, the call its buckets went ahead of)
        or as this learner's part of its node's push (``pushed``: this step's pushes so far, whose failures end the
        node's waits)."""
        if pieces is not None:
            assert isinstance(link.client, LearnerClient)
            return link.client.push(push, pieces)
        return link.client.push(push) if link.node is None else self._push_node(link, push, pushed)

    def _packed(self, link: ServerLink, index: int, grad_parts: list[Tensor]) -> Optional[list[Tensor]]:
        """The gradient's part for ``link``'s server, flat: None where it is packed into shared memory; for a node's
        push, whole (the node's sum is compressed); else compressed, if pushes are."""
        layout = link.grad_layouts[index]
        if link.node is None and link.shm is not None:
            layout.pack_into(grad_parts, link.shm.grads[index])
            return None
        packed = layout.pack(grad_parts, CPU)
        return packed if link.node is not None else self._compressed(link, index, packed)

    def _compressed(self, link: ServerLink, index: int, packed: Sequence[Tensor]) -> list[Tensor]:
        if self.feedback is None:
            return list(packed)
        # simulated learners share this Learner: each keeps its own error (its client says whose step)
        return self.feedback.compress((link.server, index, _whose(link.client)), list(packed))

    def _push_node(self, link: ServerLink, push: Push, pushed: list[InFlight]) -> Optional[Future]:
        """This learner's part of its node's push to ``link``'s server (:mod:`lightning_rudra.learner.node`).
        ``push.finite``: of the whole gradient (None: one server, this part is the whole)."""
        node = link.node
        assert node is not None and push.grads is not None
        finite = all_finite(push.grads) if push.finite is None else push.finite

        def send(summed: Push) -> Future:
            assert summed.grads is not None
            return link.client.push(replace(summed, grads=self._compressed(link, push.optimizer, summed.grads)))

        check = lambda: check_in_flight(pushed)  # noqa: E731  (the list as it grows)
        return self._failing_node(lambda: node.push(replace(push, finite=finite), send, check))

    def _failing_node(self, step: Callable[[], Any]) -> Any:
        """Run a step of node-local aggregation; if anything fails, this learner's node peers stop waiting."""
        try:
            return step()
        except BaseException:
            for link in self.links:
                if link.node is not None:
                    link.node.close(failed=True)
            raise

    def wait_for_replies(self) -> None:
        """Wait for the pushes in flight, if any, and load the weights they brought."""
        if self._in_flight is None:
            return
        in_flight, self._in_flight = self._in_flight, None
        replies = [self._load(p, in_flight.pushed) for p in in_flight.pushed]
        status = max((reply.status for reply in replies), key=STATUSES.index)  # the worst of the servers'
        staleness, lr_scale = max(reply.staleness for reply in replies), min(reply.lr_scale for reply in replies)
        if self.step_ahead is not None:
            self.step_ahead.settled(in_flight.optimizer, status, staleness, lr_scale)
        if self.on_push is not None:
            self.on_push(in_flight.optimizer, status, staleness, lr_scale)

    def _receive(self, link: ServerLink, future: Optional[Future], pushed: list[InFlight]) -> PushReply:
        if link.node is None:
            assert future is not None
            return link.client.receive(future)
        node = link.node
        return self._failing_node(lambda: node.receive(link.client, future, lambda: check_in_flight(pushed)))
