"""A learner: a module whose optimizer steps go through the parameter server (push, then pull).

On the server's host, gradients and weights move through shared memory (:mod:`lightning_rudra.transport.shm`) and RPC
carries only control; to a server on another host they go over the push stream (:mod:`lightning_rudra.transport.stream`),
and with ``shared_memory=False`` in the RPC messages (the gradients in bfloat16 with ``compression``:
:mod:`lightning_rudra.core.compression`).
Lightning-free: :class:`LearnerOptimizer` wraps any torch optimizer, so a plain training loop can use it
as well as the strategy.
"""

from dataclasses import replace
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
from torch import Tensor
from torch.futures import Future
from torch.optim import Optimizer

from lightning_rudra.core.update import Push, PushReply
from lightning_rudra.learner.buckets import Bucketing
from lightning_rudra.learner.client import LearnerClient
from lightning_rudra.learner.server_client import ServerClient
from lightning_rudra.transport.stream_pieces import PiecedCall
from lightning_rudra.learner.node import check_in_flight
from lightning_rudra.learner.optimizer import LearnerOptimizer
from lightning_rudra.learner.link import ServerLink
from lightning_rudra.core.clipping import Clipping, across_servers
from lightning_rudra.core.compression import ErrorFeedback
from lightning_rudra.core.optimizers import OptimizerSpec, hyperparameters, sharing_parameters
from lightning_rudra.core.protocol import ProtocolConfig
from lightning_rudra.core.push_checks import all_finite
from lightning_rudra.core.registration import Registration
from lightning_rudra.core.shards import ShardPlan, cuts_parameters, parts
from lightning_rudra.core.stats import Stats

_CPU = torch.device("cpu")
_SEVERITY = ("accepted", "queued", "dropped", "rejected", "late")  # a push's status over servers: the worst of theirs


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


def _whose(client: ServerClient) -> int:
    """The learner whose step pushes through ``client``: simulated learners share one client (it says whose step
    runs now)."""
    return getattr(client, "learner", client.rank)


class Learner:
    """Moves a module's gradients to the server and the server's weights into the module, through a
    :class:`~lightning_rudra.learner.server_client.ServerClient`. With several servers (one client each,
    ``clients[0]`` the one that also answers collectives), each owns a contiguous part of the parameters; a push
    goes to all at once and its reply is complete when all have answered."""

    def __init__(
        self,
        module: torch.nn.Module,
        clients: Sequence[ServerClient],
        overlap: bool = False,
        shared_memory: bool = True,
        compression: Optional[str] = None,
        bucket_cap_mb: Optional[float] = None,
    ) -> None:
        self.clients = list(clients)
        self.client = self.clients[0]
        self.overlap = overlap
        self.shared_memory = shared_memory
        # gradients pushed in RPC messages, with their rounding errors (None: in full precision)
        self.feedback = ErrorFeedback(compression) if compression is not None else None
        # pushes to other hosts' servers in buckets during the backward pass (None: after it)
        self.bucketing = Bucketing(bucket_cap_mb, self.feedback) if bucket_cap_mb else None
        self._in_flight: Optional[Pushes] = None  # not yet settled

        self.params = list(module.parameters())
        self.buffers = list(module.buffers())
        self._cut(whole=False)
        self.optimizer_params: list[list[Tensor]] = []  # per wrapped optimizer, in its groups' order
        self.orders: list[list[int]] = []  # the same, as indices into the module's parameters
        # per optimizer: the timestamps (one per server) of the oldest weights its gradient holds a
        # contribution of (None: none yet)
        self.grad_timestamps: list[Optional[tuple[int, ...]]] = []
        self._hooks: list[Any] = []
        # (optimizer, status, staleness, lr_scale) of every push: see ServerClient.receive
        self.on_push: Optional[Callable[[int, str, int, float], None]] = None
        # whether an update applies one learner's gradient alone (async, softsync with c = 1): a clipping by norm over
        # several servers then takes the norm the learner sends; hardsync's servers exchange their parts of it
        self.sends_norm = True

    def wrap(self, optimizers: Sequence[Optimizer]) -> list[Optimizer]:
        """The learner's optimizers, each wrapped in a :class:`LearnerOptimizer` that stands in for it (in a
        Trainer's ``optimizers``); their steps push from now on."""
        self._lay_out(optimizers)
        self.grad_timestamps = [None] * len(optimizers)
        for index, params in enumerate(self.optimizer_params):
            for position, p in enumerate(params):
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._stamp(index, position)))
        return [LearnerOptimizer(opt, i, self) for i, opt in enumerate(optimizers)]

    def _cut(self, whole: bool) -> None:
        """Which part of the parameters each server owns (:class:`ShardPlan`). The learner loads a slice through a
        flat view of its parameter: one that is not contiguous (channels_last) is not cut."""
        whole = whole or not all(p.is_contiguous() for p in self.params)
        self.plan = ShardPlan([p.shape for p in self.params], len(self.clients), whole)
        weights = [p.detach() for p in self.params]
        self.links = [
            ServerLink(s, client, self.plan.views(s, weights), self.buffers if s == 0 else [])
            for s, client in enumerate(self.clients)
        ]

    def check(self, optimizers: Sequence[Optimizer]) -> list[OptimizerSpec]:
        """The optimizers' specs. Before the first pull: if one is not elementwise, the servers' cuts move to the
        parameter boundaries (every learner decides alike, from the same optimizers)."""
        # which optimizers share a parameter is known here, for the whole model: each server holds a part of it
        specs = sharing_parameters([OptimizerSpec.from_optimizer(opt, self.params) for opt in optimizers])
        if self.plan.splits_a_parameter and not cuts_parameters(specs):
            if any(link.attached for link in self.links):
                raise RuntimeError(
                    "the learner pulled weights before its optimizers were known: the servers' cuts "
                    "can no longer move to parameter boundaries for a non-elementwise optimizer"
                )
            self._cut(whole=True)
        return specs

    def _lay_out(self, optimizers: Sequence[Optimizer]) -> list[OptimizerSpec]:
        """Which link holds which part of every optimizer's parameters; the optimizers' specs."""
        specs = self.check(optimizers)
        self.optimizer_params = [[p for g in opt.param_groups for p in g["params"]] for opt in optimizers]
        self.orders = [[i for idx, _ in spec.groups for i in idx] for spec in specs]
        for link in self.links:
            link.lay_out([self.plan.owned(link.server, order) for order in self.orders], self.optimizer_params)
        return specs

    def _stamp(self, index: int, position: int) -> Callable[[Tensor], None]:
        """A gradient comes from the weights its backward ran on, which may be older than the newest received
        (one backward, then two optimizers' steps; a pull in the middle of gradient accumulation). With buckets,
        the parameter's may go now."""

        def hook(param: Tensor) -> None:
            if self.grad_timestamps[index] is None:
                self.grad_timestamps[index] = self._timestamps()
            if self.bucketing is not None:
                self.bucketing.ready(index, position)

        return hook

    def forget_gradient(self, index: int) -> None:
        """The gradient of optimizer ``index`` ends (zeroed): the next one is stamped afresh."""
        self.grad_timestamps[index] = None
        if self.bucketing is not None:
            self.bucketing.forget(index)

    def backward_begins(self, index: int) -> None:
        """The backward pass of optimizer ``index``'s step runs next: with buckets, its gradient starts to go."""
        if self.bucketing is not None:
            self.bucketing.begin(index, self.optimizer_params[index], self.links)

    def backward_failed(self, error: BaseException) -> None:
        """The step's forward or backward pass raised: no push follows, the buckets sent are dropped."""
        if self.bucketing is not None:
            self.bucketing.abandon(RuntimeError(f"the step's backward pass failed: {error!r}"))

    def _timestamps(self) -> tuple[int, ...]:
        return tuple(client.timestamp for client in self.clients)

    def unwrap(self) -> None:
        """Training is over: the module's parameters no longer report their gradients to this learner (nor do
        its node's peers wait for its pushes)."""
        for link in self.links:
            if link.node is not None:
                link.node.close(failed=True)  # after finish, nothing: it is DONE already
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.bucketing is not None:
            self.bucketing.abandon(RuntimeError("training ended"))

    def register(
        self,
        config: ProtocolConfig,
        optimizers: Sequence[Optimizer],
        stats: Optional[Stats],
        optimizer_states: Optional[list[dict[str, Any]]] = None,
        module: Optional[dict[str, Any]] = None,
    ) -> None:
        """Learner 0 only: give every server its part of the starting weights and of the optimizers to rebuild
        (on resume, with their saved states and the statistics), and what a rejoining learner must match."""
        specs = self._lay_out(optimizers)
        for link in self.links:
            shard_specs = [self.plan.spec(link.server, spec) for spec in specs]
            states = (
                [
                    self.plan.split_state(link.server, order, state)
                    for order, state in zip(self.orders, optimizer_states)
                ]
                if optimizer_states
                else None
            )
            params, buffers = ([t.detach().to(_CPU, copy=True) for t in ts] for ts in (link.params, link.buffers))
            link.client.register(
                Registration(config, params, buffers, shard_specs, stats, self.shared_memory, states, module)
            )

    def snapshot(self) -> tuple[list[dict[str, Any]], Stats]:
        """Load the servers' weights, and return the optimizer states (merged over the servers) and the
        statistics of the first server; each server's part is of one clock, its own."""
        self.wait_for_replies()
        states, stats = {}, []
        for link in self.links:
            snapshot = link.client.snapshot()
            states[link.server] = snapshot.states
            link.load(snapshot.params, snapshot.buffers)
            stats.append(snapshot.stats)
        merged = [
            self._merge(index, {s: shard_states[index] for s, shard_states in states.items()})
            for index in range(len(self.orders))
        ]
        return merged, stats[0]

    def _merge(self, index: int, states: dict[int, dict[str, Any]]) -> dict[str, Any]:
        return self.plan.merge_states(self.orders[index], states)

    def optimizer_state(self, index: int) -> dict[str, Any]:
        """The servers' state of optimizer ``index``, merged."""
        return self._merge(index, {link.server: link.client.optimizer_state(index) for link in self.links})

    def load_optimizer_state(self, index: int, state: dict[str, Any]) -> None:
        for link in self.links:
            link.client.load_optimizer_state(index, self.plan.split_state(link.server, self.orders[index], state))

    def pull(self) -> None:
        self.wait_for_replies()
        for link in self.links:
            if not link.attached:
                link.attach(self.shared_memory, self.feedback.compression if self.feedback else None)
            if link.shm is not None:
                link.load_reply(None, None)
            else:
                link.load_reply(*link.client.pull())

    def push(self, index: int, optimizer: Optimizer, clipping: Sequence[Clipping] = ()) -> None:
        """Push the gradient of ``optimizer`` and continue from the weights the server gives back. With
        ``overlap`` (Rudra-adv*), continue at once from the newest weights already received: the reply to this
        push is loaded at the next push, so that communication overlaps the next step's computation.
        ``clipping``: the servers clip the gradient the update applies, by each in turn
        (:mod:`lightning_rudra.core.clipping`)."""
        try:
            self._push(index, optimizer, clipping)
        finally:
            if self.bucketing is not None:  # a call in pieces the push did not end (it failed) would hold its stream
                self.bucketing.abandon(RuntimeError("the step's push failed before it ended this call"))

    def _push(self, index: int, optimizer: Optimizer, clipping: Sequence[Clipping]) -> None:
        params = self.optimizer_params[index]
        grads = _dense(params)
        # one decision for the whole gradient: each server would otherwise refuse or apply its part alone
        finite = None if len(self.links) == 1 else all_finite(grads)
        holders = [link.server for link in self.links if link.owned[index]]
        # the norm where an update applies this gradient alone; none for a gradient the servers refuse (not finite)
        clipping = across_servers(clipping, holders, grads, index, norm=self.sends_norm and finite is not False)
        has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.bool)
        timestamps = self._gradient_timestamps(index)
        hparams = [hyperparameters(g) for g in optimizer.param_groups]
        all_buffers = self._packed_buffers()
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
            pushed.append(InFlight(link, self._send(link, push, pushed, pieces and pieces[0]), buffers))
            if pieces:
                assert self.bucketing is not None
                self.bucketing.pushed(link)
        self.wait_for_replies()
        self._in_flight = Pushes(pushed, index)
        if not self.overlap:
            self.wait_for_replies()

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
        buffers = [link.buffer_layout.pack(link.buffers, _CPU) for link in self.links]
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
        packed = layout.pack(grad_parts, _CPU)
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
        if self.on_push is not None:
            self.on_push(
                in_flight.optimizer,
                max((reply.status for reply in replies), key=_SEVERITY.index),
                max(reply.staleness for reply in replies),
                min(reply.lr_scale for reply in replies),
            )

    def _receive(self, link: ServerLink, future: Optional[Future], pushed: list[InFlight]) -> PushReply:
        if link.node is None:
            assert future is not None
            return link.client.receive(future)
        node = link.node
        return self._failing_node(lambda: node.receive(link.client, future, lambda: check_in_flight(pushed)))

    def finish(self) -> None:
        """Stop pushing and take the final weights, once every learner has stopped. Every server hears it at
        once: a learner still training waits in a hardsync round on one server only until this one is done
        there too."""
        self.wait_for_replies()
        for link in self.links:
            if link.node is not None:
                link.node.close(failed=False)
        finishing = [(link, link.client.finish()) for link in self.links]
        for link, future in finishing:
            link.load_reply(*link.client.final_weights(future))

    def load(self, flat_params: list[Tensor], flat_buffers: list[Tensor]) -> None:
        """Copy flat weights and buffers (laid out as the first server keeps them) into the module: with one
        server, all of them."""
        self.links[0].load(flat_params, flat_buffers)
