"""How the parameter server makes an update (the base of :class:`~lightning_rudra.core.protocol.Server`, whose
rules decide when): each gradient's σ counted, a gradient staler than ``max_staleness`` dropped, the others
compensated and summed; then averaged, clipped, and stepped by the server's optimizer, the buffers averaged. Plain
torch; words as in :mod:`lightning_rudra.core.protocol`."""

from functools import partial
from typing import Any, Optional, Sequence

from torch import Tensor
from torch.optim import SGD, Optimizer

from lightning_rudra.core.clipping import GlobalNorm, SyncNorm, clip, global_norm_step, squared_norm
from lightning_rudra.core.compensation import (
    CLIP_PERCENTILE,
    LOOKAHEAD_CLIP_PERCENTILE,
    NormWindow,
    StaleWeights,
    compensate,
    momentum_hyperparameters,
    record_steps,
)
from lightning_rudra.core.config import ProtocolConfig
from lightning_rudra.core.flat import FlatLayout, WeightsStore
from lightning_rudra.core.lookahead import keeps_momentum, step_with_learner_momenta
from lightning_rudra.core.optimizers import hyperparameters
from lightning_rudra.core.pending import Gradient, Pending
from lightning_rudra.core.staleness import OptimizerClocks, OwnSteps
from lightning_rudra.core.stats import Stats
from lightning_rudra.core.update import Update


class Updating:
    """The update's half of :class:`~lightning_rudra.core.protocol.Server`: the state it reads is the server's, set
    by its constructor."""

    config: ProtocolConfig
    stats: Stats
    store: WeightsStore
    param_layout: FlatLayout
    grad_layouts: list[FlatLayout]
    flat_params: list[Tensor]
    flat_buffers: list[Tensor]
    params: list[Tensor]
    optimizers: list[Optimizer]
    optimizer_params: list[list[int]]
    members: set[int]
    clocks: OptimizerClocks
    last_updates: list[Optional[Update]]
    rules: Sequence[str]
    dana: bool
    history: Optional[StaleWeights]
    norm_windows: Optional[list[NormWindow]]
    sync_norms: Optional[list[SyncNorm]]
    rules_states: list[list[dict[str, Tensor]]]
    rounds: list[int]
    awaiting_norm: dict[int, tuple[GlobalNorm, Pending, float, float]]
    _pending: list[Pending]

    @property
    def clock(self) -> int:
        return self.stats.clock

    def _staleness(self, optimizer: int, timestamp: int, own: Optional[OwnSteps]) -> int:
        """σ of a gradient of ``optimizer`` from the weights of ``timestamp``, applied now (``own``: its learner's
        steps that are no staleness to it). Under hardsync 0: every learner waits for each round, so only another
        optimizer's round of the same batch can lie in between, as in one process."""
        if self.config.protocol == "hardsync":
            return 0
        return self.clocks.staleness(optimizer, timestamp, self.clock, own)

    def weights_stats(self) -> Stats:
        """The statistics of the weights as they are (a checkpoint's): the gradients taken towards updates not yet
        applied (open, or waiting for the other servers' parts of their norm) left out of ``gradients``, ``dropped``
        and the staleness counts. A resumed shared epoch goes on after as many batches as the gradients, and their
        batches must be dealt again."""
        stats = Stats.from_dict(self.stats.to_dict())
        unapplied = list(enumerate(self._pending)) + [(o, waiting[1]) for o, waiting in self.awaiting_norm.items()]
        for optimizer, pending in unapplied:
            stats.gradients -= pending.received
            stats.dropped -= pending.received - len(pending.staleness) - sum(g.count for g in pending.waiting)
            for sigma in pending.staleness:
                stats.count_staleness(optimizer, sigma, -1)
        stats.staleness = {sigma: n for sigma, n in stats.staleness.items() if n}
        stats.optimizer_staleness = {
            optimizer: {sigma: n for sigma, n in counts.items() if n}
            for optimizer, counts in stats.optimizer_staleness.items()
        }
        return stats

    def _too_stale(self, sigma: int) -> bool:
        return self.config.max_staleness is not None and sigma > self.config.max_staleness

    def _admit(self, pending: Pending, optimizer: int, gradient: Gradient, sigma: int) -> str:
        """Drop a gradient staler than the bound, or compensate it and add it to the sum; count its σ. Returns
        its status. ``gradient.count``: how many learners' gradients it sums (a node's push)."""
        if self._too_stale(sigma):
            self.stats.dropped += 1
            return "dropped"
        if sigma and self.history is not None:
            indices = self.optimizer_params[optimizer]
            stale = self.param_layout.unpack(self.history.at(gradient.timestamp))
            compensate(
                self.rules,
                [self.params[i] for i in indices],
                [stale[i] for i in indices],
                self.grad_layouts[optimizer].unpack(gradient.grads),
                self.rules_states[optimizer],
            )
        scale = 1.0 / max(1, sigma) if self.config.lr_modulation == "per_gradient" else 1.0
        pending.add(
            gradient.grads, gradient.has_grad, gradient.buffers, sigma, scale, gradient.count, gradient.learners
        )
        self.stats.count_staleness(optimizer, sigma, gradient.count)
        return "accepted"

    def _close(self, optimizer: int, pusher: Optional[int] = None) -> Optional[Update]:
        """Average the pending gradients of ``optimizer`` into one update; None if every one was refused, or if
        its clipping waits for the other servers' parts of the norm (:attr:`awaiting_norm`). ``pusher``: the
        learner whose push closed it (None: a learner leaving did)."""
        pending, self._pending[optimizer] = self._pending[optimizer], Pending()
        # its learner made this step itself, in its program's order, if its own push closed it: unless its weights
        # may lag its pushes (overlap), or a learner leaving closed it (its weights came before, or after)
        if pending.learners == {pusher} and not self.config.overlap:
            pending.author = pusher
        self.rounds[optimizer] += 1
        for gradient in pending.waiting:  # σ counted now, as the update applies
            self._admit(pending, optimizer, gradient, self._staleness(optimizer, gradient.timestamp, gradient.own))
        self.clocks.applied(optimizer)
        if pending.grads is None:
            return None
        # set with the first gradient summed; hparams with every gradient received
        assert pending.has_grad is not None and pending.hparams is not None
        count = len(pending.staleness)
        update_staleness = sum(pending.staleness) / count
        lr_factor = 1.0 / max(1.0, update_staleness) if self.config.lr_modulation == "mean" else 1.0
        rule_scale = self._set_hyperparameters(optimizer, pending.hparams, lr_factor, count, update_staleness)
        layout = self.grad_layouts[optimizer]
        if count > 1:  # async and 1-gradient updates: no pass over the model for nothing
            for total in pending.grads:
                total.div_(count)
        flat_grads = [total.to(dtype) for total, dtype in zip(pending.grads, layout.groups)]
        indices = self.optimizer_params[optimizer]
        for i, grad, has in zip(indices, layout.unpack(flat_grads), pending.has_grad.tolist()):
            self.params[i].grad = grad if has else None
        params = [self.params[i] for i in indices]
        ahead = self._looks_ahead(optimizer)  # after _set_hyperparameters: the groups hold this update's momentum
        if self.norm_windows is not None and any(pending.staleness):  # clip: stale updates only
            percentile = self._clip_percentile(optimizer, ahead)
            if self.norm_windows[optimizer].clip([p.grad for p in params if p.grad is not None], percentile) < 1:
                self.stats.clipped += 1
        scale = sum(pending.scales) / len(pending.scales)
        # a server that holds none of the optimizer's parameters has no part of its norm: nobody waits for it
        step = global_norm_step(pending.clipping) if self.config.protocol == "hardsync" and params else None
        sync = None
        if self.sync_norms is not None and count < len(self.members):  # an update of fewer than λ gradients
            sync = partial(self.sync_norms[optimizer].ratio, params, 2 * count / (len(self.members) + count))
        if step is None:  # one server's norm, by value, or the learner's norm (an update of one gradient)
            clip(params, pending.clipping, scale, sync=sync)
            return self._step(optimizer, pending, lr_factor, rule_scale, ahead)
        clip(params, pending.clipping[:step], scale)
        servers = pending.clipping[step].servers
        wait = GlobalNorm(step, servers, squared_norm(params), self.rounds[optimizer])
        assert optimizer not in self.awaiting_norm, "hardsync's learners wait for a round before the next one"
        self.awaiting_norm[optimizer] = (wait, pending, lr_factor, rule_scale)
        return None

    def apply_norm(self, optimizer: int, total_norm: float) -> Update:
        """The hardsync update of ``optimizer`` that waited for the norm of its gradient over every server's part
        (:attr:`awaiting_norm`): clipped by it, and by the clippings after it, then applied."""
        wait, pending, lr_factor, rule_scale = self.awaiting_norm.pop(optimizer)
        params = [self.params[i] for i in self.optimizer_params[optimizer]]
        scale = sum(pending.scales) / len(pending.scales)
        clip(params, pending.clipping[wait.step :], scale, total_norm)
        return self._step(optimizer, pending, lr_factor, rule_scale, ahead=False)  # hardsync: no rule

    def _step(self, optimizer: int, pending: Pending, lr_factor: float, rule_scale: float, ahead: bool) -> Update:
        """The optimizer steps with the gradients set on the parameters (``ahead``: on the learners' own momenta,
        ``dana``); the update's buffers are averaged."""
        assert pending.buffers is not None  # set with the first gradient summed
        count = len(pending.staleness)
        indices = self.optimizer_params[optimizer]
        self.store.begin()
        try:
            if ahead:
                step_with_learner_momenta(
                    self.optimizers[optimizer],
                    [self.params[i] for i in indices],
                    self.rules_states[optimizer],
                    pending.authors,
                )
            else:
                self.optimizers[optimizer].step()
            for master, total in zip(self.flat_buffers, pending.buffers):
                master.copy_(total.div_(count) if total.is_floating_point() else total)
            self.stats.clock += 1
        finally:
            self.store.end(self.clock)
        self.clocks.updated(optimizer, self.clock, pending.author)
        if self.history is not None:
            if "gap" in self.rules:
                before = self.param_layout.unpack(self.history.at(self.clock - 1))
                params = [self.params[i] for i in indices]
                record_steps(params, [before[i] for i in indices], self.rules_states[optimizer])
            self.history.record(self.clock, self.flat_params, self.clocks.oldest(self.clock))
        for i in indices:
            self.params[i].grad = None
        update = Update(optimizer, self.clock, tuple(pending.staleness), lr_factor, tuple(pending.scales), rule_scale)
        self.last_updates[optimizer] = update
        return update

    def _looks_ahead(self, optimizer: int) -> bool:
        """``dana`` steps this optimizer on its learners' own momenta: SGD with a momentum it keeps, once its
        gradients are stale (as the ``momentum`` rule switches momentum off)."""
        opt = self.optimizers[optimizer]
        return (
            self.dana
            and isinstance(opt, SGD)
            and self.stats.mean_staleness_of(optimizer) > 0
            and any(keeps_momentum(group) for group in opt.param_groups)
        )

    def _clip_percentile(self, optimizer: int, ahead: bool) -> int:
        """``clip``'s limit for this update (``ahead``: it steps on the learners' own momenta): the outliers only where
        every group whose gradients this server holds takes dana's step; the median where any takes ``momentum``'s."""
        held = [g for g in self.optimizers[optimizer].param_groups if any(p.grad is not None for p in g["params"])]
        dana_only = ahead and all(keeps_momentum(g) for g in held)
        return LOOKAHEAD_CLIP_PERCENTILE if dana_only else CLIP_PERCENTILE

    def _set_hyperparameters(
        self,
        optimizer: int,
        hparams: Sequence[dict[str, Any]],
        lr_factor: float,
        count: int,
        update_staleness: float,
    ) -> float:
        """The learners' hyper-parameters on the server's optimizer, with the rate modulated by ``lr_factor`` and
        the ``momentum`` rule applied to ``count`` gradients of mean staleness ``update_staleness``. Returns the
        rule's factor on the first group's rate."""
        opt = self.optimizers[optimizer]
        # the mean staleness of this optimizer's gradients: another's says nothing
        mean_staleness = self.stats.mean_staleness_of(optimizer) if "momentum" in self.rules else 0.0
        rule_scales = []
        for group, hp in zip(opt.param_groups, hparams):
            group.update(hyperparameters(hp))
            group["lr"] = hp["lr"] * lr_factor
            if "momentum" in self.rules:
                rule_scales.append(
                    momentum_hyperparameters(
                        group, type(opt), count, len(self.members), mean_staleness, update_staleness, self.dana
                    )
                )
        return rule_scales[0] if rule_scales else 1.0
