"""The Rudra protocols as plain torch: the clock, staleness, when to apply an update, and learning-rate
modulation. No RPC and no Lightning here, so the semantics can be driven and checked with scripted pushes.

Words follow the paper (Gupta, Zhang, Wang, ICDM 2016): λ learners push gradients computed from weights
with timestamp ``j``; the server's clock ``i`` counts weight updates; a gradient applied at clock ``i``
has staleness σ = i - j (with several optimizers, of the updates that changed its optimizer's parameters only:
:mod:`lightning_rudra.core.staleness`).
"""

import copy
from dataclasses import replace
from typing import AbstractSet, Any, Optional, Sequence, Union

import torch
from torch import Tensor

from lightning_rudra.core.clipping import GlobalNorm, SyncNorm
from lightning_rudra.core.compensation import (
    NormWindow,
    StaleWeights,
    parse_compensation,
    with_rules_state,
    without_rules_state,
)
from lightning_rudra.core.compression import decompress
from lightning_rudra.core.config import ProtocolConfig
from lightning_rudra.core.errors import ConfigurationError
from lightning_rudra.core.flat import FlatLayout, WeightsStore
from lightning_rudra.core.node_plan import check_node_push
from lightning_rudra.core.optimizers import OptimizerSpec, sharing_parameters
from lightning_rudra.core.pending import Gradient, Pending
from lightning_rudra.core.rounds import is_late, round_ready
from lightning_rudra.core.ssp import StaleGate
from lightning_rudra.core.staleness import OptimizerClocks, OwnSteps
from lightning_rudra.core.stats import Stats
from lightning_rudra.core.push_checks import (
    all_finite,
    check_clipping,
    check_fields,
    check_optimizer,
    check_round,
    is_index,
)
from lightning_rudra.core.update import Push, PushResult, Update
from lightning_rudra.core.updating import Updating


class Server(Updating):
    """The parameter server's state and rules, driven in-process by :meth:`push`; how it makes an update once they
    say one is due: :class:`~lightning_rudra.core.updating.Updating`.

    Holds the master copy of the parameters and buffers (flat, one buffer per dtype), the clock, one
    server-side optimizer per learner optimizer, and the gradients waiting for the next update. It takes
    ownership of pushed tensors (they are summed in place).

    Buffers (e.g. BatchNorm running statistics) follow one rule: every push carries the learner's buffers,
    and each update sets the master buffers to the average (floating point) or the last value (integer) of
    the buffers pushed with the gradients in it.

    Staleness is counted when a gradient is applied: σ = updates of its optimizer's parameters since the weights
    it came from (:mod:`lightning_rudra.core.staleness`; one optimizer: the updates of the model). Only its own
    updates move that count between a gradient's arrival and its update, so it is summed on arrival; unless
    another optimizer shares a parameter with it: then its gradients waiting for a softsync update are kept whole
    until it applies (memory: up to c gradients of that optimizer).
    An update is due once c gradients were received (rejected ones do not count; dropped ones do).
    """

    def __init__(
        self,
        config: ProtocolConfig,
        params: Sequence[Tensor],
        buffers: Sequence[Tensor],
        optimizers: Sequence[OptimizerSpec],
        stats: Optional[Stats] = None,
        store: Optional[WeightsStore] = None,
    ) -> None:
        self.config = config
        self.stats = stats or Stats()
        self.store = store or WeightsStore()
        self.param_layout = FlatLayout(params)
        self.buffer_layout = FlatLayout(buffers)
        self.store.begin()
        self.flat_params = self._stored("params", self.param_layout, params)
        self.flat_buffers = self._stored("buffers", self.buffer_layout, buffers)
        self.store.end(self.clock)
        self.params = self.param_layout.unpack(self.flat_params)
        optimizers = sharing_parameters(optimizers)
        self.optimizers = [spec.build(self.params) for spec in optimizers]
        # per optimizer: the model-parameter indices it updates, and the layout of its pushed gradients
        self.optimizer_params = [[i for idx, _ in spec.groups for i in idx] for spec in optimizers]
        self.grad_layouts = [FlatLayout([params[i] for i in idx]) for idx in self.optimizer_params]
        self.active = set(range(config.num_learners))  # learners still pushing
        self.members = set(range(config.num_learners))  # learners not lost: c counts them
        self._pending = [Pending() for _ in optimizers]
        touches = [frozenset({k, *spec.shares_with}) for k, spec in enumerate(optimizers)]
        self.clocks = OptimizerClocks(touches, config.num_learners, self.clock, config.max_staleness)
        # σ may change between a gradient's arrival and its update (another optimizer's update changes its weights)
        self._defer = any(len(touched) > 1 for touched in touches)
        self.last_updates: list[Optional[Update]] = [None] * len(optimizers)
        # hardsync and batchsync apply no stale gradient: no rule (they stay SGD with batch μλ, Kμ)
        self.rules = parse_compensation(config.compensation) if config.protocol in ("softsync", "async") else ()
        self.dana = "dana" in self.rules  # momentum SGD: each learner's momentum (core/lookahead.py)
        self.history = (
            StaleWeights(config.num_learners, self.clock, self.flat_params) if {"dc", "gap"} & set(self.rules) else None
        )
        # clip: the recent stale updates' gradient norms, per optimizer
        self.norm_windows = [NormWindow() for _ in optimizers] if "clip" in self.rules else None
        # syncnorm: the running mean of the updates' gradients a clipping by norm is scaled by, per optimizer
        self.sync_norms = [SyncNorm() for _ in optimizers] if "syncnorm" in self.rules else None
        # the running means of dc and gap: per optimizer, per parameter (its order), beside its own state
        self.rules_states: list[list[dict[str, Tensor]]] = [[{} for _ in idx] for idx in self.optimizer_params]
        # hardsync rounds closed per optimizer, and the one whose clipping waits for the other servers' norms
        self.rounds = [0] * len(optimizers)
        self.awaiting_norm: dict[int, tuple[GlobalNorm, Pending, float, float]] = {}
        self.gate = self._gate(len(optimizers))
        self.away: AbstractSet[int] = frozenset()  # learners waiting at a collective: a backup round does not wait
        if config.discards_late and len(optimizers) > 1:
            rule = "protocol='batchsync'" if config.protocol == "batchsync" else f"backup={config.backup}"
            raise ConfigurationError(
                f"{rule} is not available with {len(optimizers)} optimizers: a learner's gradient of one optimizer could be applied while its gradient of another "
                "comes late and is not, leaving half a step of its batch. Use one optimizer, or protocol='hardsync' "
                "without backup, softsync or async."
            )

    def _gate(self, num_optimizers: int) -> Optional[StaleGate]:
        """on_stale='block': what holds pushes back (:mod:`lightning_rudra.core.ssp`); None: stale ones are dropped."""
        if self.config.on_stale != "block":
            return None
        assert self.config.max_staleness is not None  # refused by ProtocolConfig otherwise
        if num_optimizers > 1:
            raise ConfigurationError(
                f"on_stale='block' is not available with {num_optimizers} optimizers: a learner pushes them one after "
                "the other, so a push held back for another learner whose push of another optimizer is held back "
                "in turn would wait for ever. Use on_stale='drop' (max_staleness drops the stale gradients), or one "
                "optimizer."
            )
        return StaleGate(self.config.max_staleness, self.config.num_learners, self.clock)

    def _stored(self, name: str, layout: FlatLayout, tensors: Sequence[Tensor]) -> list[Tensor]:
        return [
            self.store.allocate(f"{name}-{i}", flat.numel(), flat.dtype).copy_(flat)
            for i, flat in enumerate(layout.pack(tensors, torch.device("cpu")))
        ]

    def pull(self) -> tuple[list[Tensor], list[Tensor], int]:
        """A copy of the current weights and buffers (flat), and their timestamp."""
        return [f.clone() for f in self.flat_params], [f.clone() for f in self.flat_buffers], self.clock

    def push(self, push: Push) -> PushResult:
        """Take one gradient (:class:`~lightning_rudra.core.update.Push`): ``push.grads`` is packed with the gradient
        layout of its optimizer, computed from weights with its timestamp. ``push.finite``: whether the gradient has
        no NaN or Inf, if the learner checked (the whole gradient, when this server holds only part of the model);
        None: checked here.

        Everything is checked before anything changes: a bad push raises and leaves the server as it was.
        A compressed gradient (:mod:`lightning_rudra.core.compression`) is widened first.

        A node's push (hardsync, :mod:`lightning_rudra.core.node_plan`): ``grads`` is the sum of the gradients of
        ``learner`` and ``members`` but those in ``refused`` (not finite, left out by the learner that summed), and
        ``buffers`` the sum of their floating-point buffers; it counts as the gradient of each of them, so that the
        update is still the mean over every learner's gradient.

        ``clipping``: the learner asks that the gradient its update applies be clipped, by each in turn
        (:mod:`lightning_rudra.core.clipping`); the newest push's request holds for the update. Under hardsync every
        push of a round must ask what its first push asked (refused otherwise), and a round clipped by norm over
        several servers closes without stepping (:attr:`awaiting_norm`) until :meth:`apply_norm`.

        Args:
            push: the learner's gradient for this server, with what it asks of the update.

        With ``on_stale="block"`` a push whose update could make another learner's gradient staler than
        ``max_staleness`` is held back (status ``held``, nothing changed but the gate): :meth:`release` applies it
        once it may go (:mod:`lightning_rudra.core.ssp`).

        Under ``protocol="batchsync"`` and ``backup``, a gradient that comes after its round closed is not applied
        (status ``late``, nothing changed but the count): :mod:`lightning_rudra.core.rounds`.

        Returns:
            what became of the gradient, and the update it closed, if any.
        """
        push = self._checked(push)
        if is_late(self.config, push.timestamp, self.clock):  # its round closed: not applied, its batch dealt again
            self.stats.late += 1
            return PushResult("late", self.clock - push.timestamp)
        if self.gate is not None:
            if self.gate.holds(push.learner):
                raise ValueError(
                    f"push from learner {push.learner} refused: its previous push is held back (on_stale='block') "
                    "and has had no reply yet; a learner pushes again once it has its reply."
                )
            # a gradient with NaN or Inf is refused (or raises) at once, to its own learner: it changes no clock, and
            # refused only when another learner's push let it go, that push's reply would carry the error
            if push.finite is None and push.grads is not None:
                push = replace(push, finite=all_finite(push.grads))
            if push.finite is not False and not self.gate.may_take(
                push, self.active, self.clock, self._received(), self.gradients_per_update
            ):
                self.gate.hold(push)
                self.stats.held += 1
                return PushResult("held", self._staleness(push.optimizer, push.timestamp, None))
        return self._apply(push)

    def release(self, away: AbstractSet[int] = frozenset()) -> list[tuple[Push, Union[PushResult, Exception]]]:
        """on_stale='block': apply the held pushes that may go now, oldest first, with what became of each (their
        replies are due): a push whose application raised gets its error, and the others go on. ``away``: the
        learners waiting at a collective, who push nothing until it completes, so nobody waits for them."""
        if self.gate is None:
            return []
        self.gate.away = frozenset(away)
        released: list[tuple[Push, Union[PushResult, Exception]]] = []
        while (
            push := self.gate.next_ready(self.active, self.clock, self._received(), self.gradients_per_update)
        ) is not None:
            try:
                released.append((push, self._apply(push)))
            except Exception as error:  # its own learner's, not that of the call that let it go
                self.gate.applied(push.learner, self.clock)  # refused, as it would have been on arrival
                released.append((push, error))
        return released

    def _received(self) -> int:
        return self._pending[0].received if self._pending else 0

    def _apply(self, push: Push) -> PushResult:
        """Take a checked push that may go now (see :meth:`push`)."""
        pending = self._pending[push.optimizer]
        own = self.clocks.own_steps(push.learner, push.optimizer, self.clock)
        sigma = self._staleness(push.optimizer, push.timestamp, own)
        status = self._take(push, pending, own, sigma)
        group = [push.learner, *push.members]
        self.stats.gradients += len(group)
        if self.config.protocol == "hardsync" and pending.asked_by is None:  # what the round's pushes must ask
            pending.asked_by, pending.clipping = push.learner, tuple(push.clipping)
        pending.learners.update(group)
        for who in group:
            self.clocks.pushed(who, push.optimizer, push.timestamp, self.clock)
        if not self._ready(pending):
            self._handed(push.learner)
            return PushResult(status, sigma)
        update = self._close(push.optimizer, push.learner)
        if status == "queued":  # applied just now, with the σ it arrived with
            status = "dropped" if self._too_stale(sigma) else "accepted"
        self._handed(push.learner)
        return PushResult(status, sigma, closed=True, update=update)

    def _handed(self, learner: int) -> None:
        """``learner``'s push was taken: its reply hands it the newest weights."""
        if self.gate is not None:
            self.gate.applied(learner, self.clock)

    def _checked(self, push: Push) -> Push:
        """``push``, its gradient widened and its clippings as the update applies them, once every check passed
        (:mod:`lightning_rudra.core.push_checks`)."""
        optimizer = push.optimizer
        self._check_learner(push.learner)
        check_optimizer(optimizer, len(self.optimizers))
        if isinstance(push.grads, (list, tuple)):
            push = replace(push, grads=decompress(push.grads, list(self.grad_layouts[optimizer].groups)))
        num_groups = len(self.optimizers[optimizer].param_groups)
        check_fields(push, self.grad_layouts[optimizer], num_groups, self.buffer_layout, self.clock)
        clipping = check_clipping(push, self.config, self.gradients_per_update)
        group = [push.learner, *push.members]
        check_node_push(self.config.protocol, group, push.refused, self._check_learner)
        if self.config.protocol == "hardsync":
            check_round(push, group, self._pending[optimizer], clipping, self.clock)
        return replace(push, clipping=clipping)

    def _take(self, push: Push, pending: Pending, own: Optional[OwnSteps], sigma: int) -> str:
        """Refuse a gradient that is not finite, or count it towards the update: kept whole until the update
        (another optimizer may change its σ), or admitted now. Returns its status."""
        count = len(push.members) + 1 - len(push.refused)  # the gradients summed in grads
        finite = False if push.refused and self.config.nonfinite == "raise" else push.finite
        assert push.grads is not None  # the server process reads a gradient in shared memory before
        if finite is None:
            finite = all_finite(push.grads)
        if not finite or not count:
            if self.config.nonfinite == "raise":
                raise FloatingPointError(
                    f"learner {push.refused[0] if push.refused else push.learner} pushed a gradient with NaN or Inf "
                    f"for optimizer {push.optimizer}; the weights were left unchanged (nonfinite='raise')."
                )
            self.stats.rejected += len(push.members) + 1
            return "rejected"
        self.stats.rejected += len(push.refused)
        pending.received += count
        pending.hparams = list(push.hparams)
        pending.clipping = tuple(push.clipping)
        learners = tuple(who for who in (push.learner, *push.members) if who not in push.refused)
        gradient = Gradient(push.grads, push.has_grad, push.buffers, push.timestamp, count, own, learners)
        if self._defer:
            pending.waiting.append(gradient)
            self.clocks.queued(push.optimizer, push.timestamp)
            return "queued"
        return self._admit(pending, push.optimizer, gradient, sigma)

    def finish(self, learner: int) -> list[int]:
        """A learner has stopped pushing. Hardsync rounds now wait only for the learners still active; when the
        last learner finishes, gradients still waiting for a softsync update are applied, not lost. Returns the
        optimizers whose wait this closed."""
        self._check_learner(learner)
        self.active.discard(learner)
        self.clocks.left(learner)  # it pushes from no old weights any more
        if self.gate is not None:
            self.gate.left(learner)
        closed = [i for i, p in enumerate(self._pending) if p.learners and (self._ready(p) or not self.active)]
        for optimizer in closed:
            self._close(optimizer)
        return closed

    def remove(self, learner: int) -> list[int]:
        """A learner is lost (``min_learners``): it stops pushing, as with :meth:`finish`, and softsync's c is
        ⌊λ'/n⌋ of the λ' learners left (at least 1) from now on. Its push held back (``on_stale="block"``), if any, is
        not applied: its gradient may lie in the shared memory that goes with its process. Returns the optimizers
        whose wait this closed."""
        self.members.discard(learner)
        if self.gate is not None:
            self.gate.discard(learner)
        return self.finish(learner) if learner in self.active else []

    def add(self, learner: int) -> None:
        """A lost learner is back: it pushes again, a hardsync round open now waits for it too, and softsync's c
        counts it."""
        self.members.add(learner)
        self.active.add(learner)
        self.clocks.joined(learner, self.clock)
        if self.gate is not None:
            self.gate.joined(learner, self.clock)

    @property
    def gradients_per_update(self) -> int:
        """c of the learners left: the configuration's c until a learner is lost."""
        if self.config.protocol == "softsync":
            return max(1, len(self.members) // self.config.n)
        return self.config.gradients_per_update

    def optimizer_state(self, optimizer: int) -> dict[str, Any]:
        """A copy of the optimizer's state dict, with the compensation rules' state of its parameters: torch's
        ``state_dict`` holds the live buffers, which the next update changes in place, so a checkpoint written
        after the server's lock was let go would mix clocks."""
        return copy.deepcopy(with_rules_state(self.optimizers[optimizer].state_dict(), self.rules_states[optimizer]))

    def load_optimizer_state(self, optimizer: int, state: dict[str, Any]) -> None:
        own, self.rules_states[optimizer] = without_rules_state(state, len(self.optimizer_params[optimizer]))
        self.optimizers[optimizer].load_state_dict(own)

    def load_optimizer_states(self, states: Sequence[dict[str, Any]]) -> None:
        """On resume: the saved state of every optimizer (none: start afresh)."""
        if states and len(states) != len(self.optimizers):
            raise ValueError(
                f"{len(states)} optimizer states to restore for {len(self.optimizers)} optimizers: "
                "the checkpoint was saved from a module with a different configure_optimizers."
            )
        for i, state in enumerate(states):
            self.load_optimizer_state(i, state)

    def open_update(self, optimizer: int = 0) -> tuple[int, frozenset[int]]:
        """The gradients received towards ``optimizer``'s next update, and the learners who pushed them."""
        pending = self._pending[optimizer]
        return pending.received, frozenset(pending.learners)

    def awaited(self, optimizer: int) -> set[int]:
        """The learners whose gradient the open hardsync round of ``optimizer`` still waits for."""
        return self.active - self._pending[optimizer].learners

    def _ready(self, pending: Pending) -> bool:
        return round_ready(self.config, pending, self.active, self.away, self.gradients_per_update)

    def meet(self, away: AbstractSet[int]) -> list[int]:
        """The learners of ``away`` wait at a collective (they push nothing until it completes): a backup round
        that waits only for them closes now. Returns the optimizers whose round this closed."""
        self.away = frozenset(away)
        if not self.config.backup:
            return []
        closed = [i for i, p in enumerate(self._pending) if p.learners and self._ready(p)]
        for optimizer in closed:
            self._close(optimizer)
        return closed

    def _check_learner(self, learner: int) -> None:
        if not is_index(learner):
            raise ValueError(
                f"learner {learner!r} is not a learner's index: expected an int (not a bool), one of the active "
                f"learners {sorted(self.active)} (λ={self.config.num_learners})."
            )
        if learner not in self.active:
            state = (
                "is unknown"
                if learner not in range(self.config.num_learners)
                else "was lost"
                if learner not in self.members
                else "has already finished"
            )
            raise ValueError(
                f"learner {learner!r} {state}: expected one of the active learners "
                f"{sorted(self.active)} (λ={self.config.num_learners})."
            )
