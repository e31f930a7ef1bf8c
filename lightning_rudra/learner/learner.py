"""A learner: a module whose optimizer steps go through the parameter server (push, then pull).

On the server's host, gradients and weights move through shared memory (:mod:`lightning_rudra.transport.shm`) and RPC
carries only control; to a server on another host they go over the push stream (:mod:`lightning_rudra.transport.stream`),
and with ``shared_memory=False`` in the RPC messages (the gradients in bfloat16 with ``compression``:
:mod:`lightning_rudra.core.compression`).
Lightning-free: :class:`LearnerOptimizer` wraps any torch optimizer, so a plain training loop can use it
as well as the strategy.
"""

from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_rudra.core.clipping import Clipping
from lightning_rudra.core.compression import ErrorFeedback
from lightning_rudra.core.lookahead import StepAhead
from lightning_rudra.core.optimizers import OptimizerSpec, sharing_parameters
from lightning_rudra.core.protocol import ProtocolConfig
from lightning_rudra.core.registration import Registration
from lightning_rudra.core.shards import ShardPlan, cuts_parameters
from lightning_rudra.core.stats import Stats
from lightning_rudra.learner.buckets import Bucketing
from lightning_rudra.learner.link import ServerLink
from lightning_rudra.learner.optimizer import LearnerOptimizer
from lightning_rudra.learner.pushing import CPU, Pushes, Pushing
from lightning_rudra.learner.server_client import ServerClient


class Learner(Pushing):
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
        # overlap with dana: the learner's own step on its weights while its push is in flight (None: none)
        self.step_ahead: Optional[StepAhead] = None

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
            params, buffers = ([t.detach().to(CPU, copy=True) for t in ts] for ts in (link.params, link.buffers))
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
