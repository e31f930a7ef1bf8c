"""Staleness compensation: how the server treats stale gradients so that softsync and async keep the accuracy of
the synchronous run, with the optimizer and learning rate tuned for it. Plain torch.

A rule is one of ``COMPENSATIONS``, or several joined by ``+`` (``"momentum+dc"``); the default,
``DEFAULT_COMPENSATION``, is ``"momentum+clip+syncnorm+dana"``. With σ = 0 (hardsync, one learner) every rule is the
identity, so hardsync stays SGD with batch μλ and async with one learner plain SGD.

``momentum`` (a step that stays stable under delay). A synchronous update averages λ gradients, a stale one
c = ⌊λ/n⌋ (async: 1), so every optimizer's rate is scaled by c/λ (the paper's α0/⟨σ⟩ is c/λ in expectation, since
⟨σ⟩ ≈ n, but c/λ does not depend on the timing). For SGD, once the mean staleness ⟨σ⟩ of the optimizer's own
gradients is above 0, its momentum β is switched off too and an update's step, lr/(1 − β), is scaled by
min(c/λ, 1/(σ + 1)) instead, σ being the staleness of the gradients this update applies (their mean under
n-softsync): the paper's per-gradient α0/σ, bounded by c/λ. Why no momentum: a gradient τ updates late makes
heavy-ball SGD unstable once step × curvature exceeds about π/(2τ + 1), whatever the momentum, and the largest
stable step is reached with no momentum; a synchronous run with momentum 0.9 tolerates 38, so a rate tuned for it
goes over the stale edge (asynchrony is itself a momentum: Mitliagkas et al., "Asynchrony begets momentum", 2016).
Why each update's own σ: a straggler's gradient (σ ≈ 3 with 2 learners) takes a quarter of the step while the
others' fresh ones move as far per sample as the synchronous run. A cap on the run's mean cannot tell them apart:
1/(2⟨σ⟩ + 1) held the fresh ones back (4 real learners without a straggler needed 1.15× DDP's time to its
accuracy), 1/(⟨σ⟩ + 1) let the straggler's through at the full step (3 of 15 real runs with 2 learners and a 3×
straggler ended far below their best; benchmarks/results/history/milder-sgd-cap). A gradient σ late then stays
stable where the synchronous run's step × curvature is below about 2 (σ ≤ 1), 1.85 (σ = 2), and never below π/2:
a rate tuned to the edge of the synchronous run can exceed it, and ``clip`` is what catches that (without it,
every async and 4-softsync run with momentum SGD on the staleness study's CNN ended at chance). Adam and the other
optimizers keep their moments (an adaptive step is bounded by about lr whatever the curvature), and an update of
theirs that averages more than one gradient (n-softsync) is capped at 1/(2⟨σ⟩ + 1): the average's smaller noise
lets Adam's normalized step grow towards its full rate, and without the cap 4-softsync at λ = 16 ended 18 points
above hardsync under ``momentum+clip`` on the staleness study's CNN (docs/study/staleness/findings.md).

``dana`` (with ``momentum``): momentum SGD keeps its momentum under staleness, one buffer per learner on the server,
and the server's weights are the look-ahead point the learners' momenta are about to reach, so a gradient is stale
by the others' gradients only, not by the momentum that dominates a step (DANA-Zero: Hakimi et al., 2019; as
Nesterov's step of torch's SGD on the pushing learner's own buffer, :mod:`lightning_rudra.core.lookahead`). The rate
is the one ``momentum`` scales, lr · min(c/λ, 1/(σ + 1)), without the 1/(1 − β). As its steps are the synchronous
run's, ``clip`` limits dana's updates to the ``LOOKAHEAD_CLIP_PERCENTILE``-th percentile of the recent norms, the
outliers only; without ``clip`` some runs still blew up (the staleness study's CNN, 4-softsync and async λ = 30).
With it, the study's CNN stays within 2 points of hardsync's error after 13–16 epochs against hardsync's 20
(docs/study/staleness/findings.md). Other optimizers, a dampened momentum and plain SGD are ``momentum``'s.

``dc`` (delay compensation, DC-ASGD-a: Zheng et al., ICML 2017): a gradient computed on weights w_stale and
applied at w_now becomes g + λ0 · g ⊙ g / sqrt(MS) ⊙ (w_now − w_stale), the first-order Taylor correction with
g ⊙ g standing for the Hessian's diagonal; MS is the running mean of g ⊙ g (0.95), λ0 = ``DC_LAMBDA``.

``gap`` (gap-aware damping: Barkai, Hakimi, Schuster, ICLR 2020): the gradient is divided, element by element,
by max(1, |w_now − w_stale| / C), the gap between the weights it was computed on and the current ones in units
of C, the running mean of one update's |Δw| (0.9).

``clip`` (percentile clipping of stale gradients, as AutoClip: Seetharaman et al., 2020): the gradient of an update
that applies a stale gradient is scaled down to at most the median norm of the last ``CLIP_WINDOW`` such updates'
gradients (``CLIP_PERCENTILE``; none is clipped before ``CLIP_WARMUP`` of them), or, where every group with a
gradient takes ``dana``'s step, to the ``LOOKAHEAD_CLIP_PERCENTILE``-th percentile. A stale gradient taken at a rate
tuned to the edge of the synchronous run's stability can start a blow-up that the synchronous run never sees; the
median of recent norms caps it without a rate of its own. Its norms are of this server's part of the gradient, kept
per optimizer; they are not saved (after a resume the window fills again).

``syncnorm`` (with ``momentum``): a user's clipping by norm of an update of c < λ gradients clips it by the norm of
the synchronous update it stands for, estimated by a running mean of the updates' gradients
(:class:`~lightning_rudra.core.clipping.SyncNorm`), not by its own, noisier norm: clipped by its own, λ/c updates
moved far less than one synchronous update where the noise dominates (the staleness study's CNN and MLP with
clipped SGD ended up to 7.2 points above hardsync, 3 of 8 configurations more than 2; with it, 2.9 to 9.0 below).

``dc`` and ``gap`` need w_stale: the server keeps the weights of every clock a learner may still push from (the
oldest is the oldest timestamp among the learners' last pushes), at most ``HISTORY_PER_LEARNER`` · λ + 1 copies of
the parameters; a gradient older than the oldest kept is compared with the oldest kept. Their running means are
kept beside the optimizer's state, not in it (torch's adaptive optimizers create their state at a parameter's
first gradient only where they find none), and travel in its state dict under ``state[RULES_STATE]``, one entry
per parameter as the optimizer's own (a key torch's ``load_state_dict`` keeps as it is): checkpoints hold them, cut
at the servers' cuts like the rest. The copies are not saved: after a resume every learner starts from the
restored weights.
"""

import bisect
import math
from collections import deque
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from lightning_rudra.core.clipping import norm64
from lightning_rudra.core.errors import ConfigurationError
from lightning_rudra.core.lookahead import keeps_momentum

COMPENSATIONS = ("none", "momentum", "dc", "gap", "clip", "syncnorm", "dana")
DC_LAMBDA = 0.2
DC_DECAY = 0.95
GAP_DECAY = 0.9
HISTORY_PER_LEARNER = 2
CLIP_PERCENTILE = 50
# dana's updates keep the synchronous run's momentum and step, so clip catches outliers only: at the median, real
# async learners trailed DDP's accuracy at half its epochs (benchmarks/results/accuracy.md, docs/study.md)
LOOKAHEAD_CLIP_PERCENTILE = 90
CLIP_WINDOW = 1000
CLIP_WARMUP = 10
# optimizers whose step does not follow the gradient's size: a rate scaled by c/λ means nothing to them
_SIGN_BASED = ("Rprop",)


# chosen across model families and optimizers: docs/study/staleness/findings.md
DEFAULT_COMPENSATION = "momentum+clip+syncnorm+dana"
# where an optimizer's state dict carries the rules' running means (position -> {name: tensor})
RULES_STATE = "rudra_compensation"
# where the first releases kept them: in the optimizer's own entries (read from older checkpoints)
_OLD_KEYS = {"rudra_dc_mean_square": "dc_mean_square", "rudra_gap_step": "gap_step"}


def staleness_options(lr_modulation: Optional[str], compensation: Optional[str]) -> tuple[str, str]:
    """(lr_modulation, compensation) from what the user set (None: not set). Neither: the default compensation.
    Only ``lr_modulation`` (any value, "none" included): that alone, as before compensation existed, so a config
    that names its rule keeps its meaning."""
    if compensation is None:
        compensation = DEFAULT_COMPENSATION if lr_modulation is None else "none"
    return lr_modulation or "none", compensation


def parse_compensation(compensation: str) -> tuple[str, ...]:
    """The rules of ``compensation`` (``"none"``: no rule), or a ValueError naming what is wrong."""
    rules = tuple(compensation.split("+")) if isinstance(compensation, str) else ()
    if (
        not rules
        or any(rule not in COMPENSATIONS for rule in rules)
        or len(set(rules)) != len(rules)
        or ("none" in rules and len(rules) > 1)
    ):
        raise ConfigurationError(
            f"compensation={compensation!r} is not supported: expected 'none' or one or more of "
            f"{', '.join(repr(r) for r in COMPENSATIONS[1:])} joined by '+' (e.g. 'momentum+dc')."
        )
    if "syncnorm" in rules and "momentum" not in rules:
        raise ConfigurationError(
            f"compensation={compensation!r}: 'syncnorm' clips a stale update by the norm of the synchronous update "
            "that the 'momentum' rule scales its rate to a part of; without that scaling one update could move "
            "(λ + 1)/2 times the clipping's limit. Use it with 'momentum' (e.g. 'momentum+clip+syncnorm')."
        )
    if "dana" in rules and "momentum" not in rules:
        raise ConfigurationError(
            f"compensation={compensation!r}: 'dana' keeps momentum SGD's momentum per learner where the 'momentum' "
            "rule would switch it off, at the rate that rule scales. Use it with 'momentum' (e.g. 'momentum+dana')."
        )
    return () if rules == ("none",) else rules


def check_optimizer(rules: Sequence[str], optimizer: type, name: str) -> None:
    """Refuse a rule the optimizer cannot take, at setup (``name``: how to call the optimizer in the message)."""
    if "momentum" in rules and optimizer.__name__ in _SIGN_BASED:
        raise ConfigurationError(
            f"compensation 'momentum' scales the learning rate, which {name} does not "
            "apply to the gradient's size (its steps follow the gradient's sign): use "
            "compensation='none' or 'dc'/'gap'/'clip' with it, or another optimizer."
        )


def momentum_hyperparameters(
    group: dict[str, Any],
    optimizer: type,
    gradients_per_update: int,
    num_learners: int,
    mean_staleness: float,
    update_staleness: float,
    dana: bool = False,
) -> float:
    """The ``momentum`` rule on one parameter group of an ``optimizer`` (its lr and momentum as the learner sent
    them), in place: ``mean_staleness`` is the run's ⟨σ⟩ of this optimizer's gradients, ``update_staleness`` the
    mean σ of the gradients this update averages; ``dana``: SGD's momentum kept as a look-ahead
    (:mod:`lightning_rudra.core.lookahead`) instead of switched off. Returns the factor its rate was multiplied by."""
    scale = gradients_per_update / num_learners
    if mean_staleness > 0 and issubclass(optimizer, torch.optim.SGD):
        scale = min(scale, 1 / (update_staleness + 1))
        if dana and keeps_momentum(group):
            group["nesterov"] = True
        elif group.get("momentum", 0):
            scale *= (1 - group.get("dampening", 0)) / (1 - group["momentum"])
            group["momentum"] = 0.0
            group["nesterov"] = False
    elif mean_staleness > 0 and gradients_per_update > 1:
        scale = min(scale, 1 / (2 * mean_staleness + 1))
    group["lr"] *= scale
    return scale


def with_rules_state(state_dict: dict[str, Any], rules: Sequence[dict[str, Tensor]]) -> dict[str, Any]:
    """An optimizer's ``state_dict`` with the rules' running means of its parameters (``rules``, in its order)."""
    kept = {position: dict(entry) for position, entry in enumerate(rules) if entry}
    return {**state_dict, "state": {**state_dict["state"], RULES_STATE: kept}} if kept else state_dict


def without_rules_state(state_dict: dict[str, Any], num_params: int) -> tuple[dict[str, Any], list[dict[str, Tensor]]]:
    """An optimizer's state dict (``with_rules_state``'s, or an older one with them in its entries) parted into its
    own state and the rules' running means of its ``num_params`` parameters (copies)."""
    rules: list[dict[str, Tensor]] = [{} for _ in range(num_params)]

    def of(position: Any) -> dict[str, Tensor]:
        if int(position) not in range(num_params):
            raise ValueError(
                f"the saved compensation state names parameter {position!r} of an optimizer of {num_params} "
                "parameters: the checkpoint was saved from a module with a different configure_optimizers."
            )
        return rules[int(position)]

    own = {}
    for key, entry in state_dict["state"].items():
        if key == RULES_STATE:
            for position, means in entry.items():
                of(position).update({name: mean.clone() for name, mean in means.items()})
        elif isinstance(entry, dict) and _OLD_KEYS.keys() & entry.keys():
            of(key).update({_OLD_KEYS[name]: entry[name].clone() for name in _OLD_KEYS.keys() & entry.keys()})
            entry = {name: value for name, value in entry.items() if name not in _OLD_KEYS}
            if entry:  # none of the optimizer's own: it creates them at the parameter's next gradient
                own[key] = entry
        else:
            own[key] = entry
    return {**state_dict, "state": own}, rules


class StaleWeights:
    """The weights of the clocks a learner may still push from (for ``dc`` and ``gap``), as flat copies."""

    def __init__(self, num_learners: int, clock: int, flat_params: Sequence[Tensor]) -> None:
        self.capacity = HISTORY_PER_LEARNER * num_learners + 1
        self.copies: dict[int, list[Tensor]] = {}
        self.record(clock, flat_params, clock)

    def record(self, clock: int, flat_params: Sequence[Tensor], oldest: int) -> None:
        """The weights of ``clock``, just made (after an update, or at the start); no learner pushes from weights
        older than ``oldest`` any more."""
        for old in [c for c in self.copies if c < oldest]:
            del self.copies[old]
        while len(self.copies) >= self.capacity:
            del self.copies[min(self.copies)]
        self.copies[clock] = [f.clone() for f in flat_params]

    def at(self, timestamp: int) -> list[Tensor]:
        return self.copies[timestamp] if timestamp in self.copies else self.copies[min(self.copies)]


def compensate(
    rules: Sequence[str],
    params: Sequence[Tensor],
    stale: Sequence[Tensor],
    grads: Sequence[Tensor],
    state: Sequence[dict[str, Any]],
) -> None:
    """The ``dc`` and ``gap`` rules on one stale gradient, in place: per parameter, its current weights, the
    weights the gradient came from, the gradient, and the rules' running means of that parameter."""
    for w, w_stale, g, st in zip(params, stale, grads, state):
        gap = w - w_stale
        if "dc" in rules:
            square = g * g
            mean_square = st.get("dc_mean_square")
            if mean_square is None:
                mean_square = st["dc_mean_square"] = square.clone()
            else:
                mean_square.mul_(DC_DECAY).add_(square, alpha=1 - DC_DECAY)
            g.add_(square.mul_(gap).div_(mean_square.sqrt().add_(1e-7)), alpha=DC_LAMBDA)
        if "gap" in rules and "gap_step" in st:
            g.div_(gap.abs_().div_(st["gap_step"].add(1e-12)).clamp_(min=1.0))


def record_steps(params: Sequence[Tensor], before: Sequence[Tensor], state: Sequence[dict[str, Any]]) -> None:
    """``gap``: the running mean of one update's |Δw|, per parameter, after an update from ``before``."""
    for w, w_before, st in zip(params, before, state):
        step = (w - w_before).abs_()
        mean = st.get("gap_step")
        if mean is None:
            st["gap_step"] = step
        else:
            mean.mul_(GAP_DECAY).add_(step, alpha=1 - GAP_DECAY)


class NormWindow:
    """``clip``: the norms of the last ``CLIP_WINDOW`` stale updates' gradients of one optimizer, kept sorted."""

    def __init__(self) -> None:
        self.norms: deque[float] = deque()
        self.ordered: list[float] = []

    def clip(self, grads: Sequence[Tensor], percentile: int = CLIP_PERCENTILE) -> float:
        """Record the norm of ``grads`` (one update's) and scale them in place to at most the window's
        ``percentile``-th percentile, once it holds ``CLIP_WARMUP`` norms. Returns the factor applied."""
        if not grads:  # this server holds none of the optimizer's gradients
            return 1.0
        # in float64: a finite float32 gradient's norm cannot overflow to inf and escape the clip
        norm = norm64(grads)
        # a zero gradient says nothing of the size of a step (and a zero median would zero every stale update); a
        # non-finite one is the nonfinite option's to refuse or apply, as without this rule
        if norm == 0 or not math.isfinite(norm):
            return 1.0
        if len(self.norms) == CLIP_WINDOW:
            self.ordered.pop(bisect.bisect_left(self.ordered, self.norms.popleft()))
        self.norms.append(norm)
        bisect.insort(self.ordered, norm)
        if len(self.ordered) < CLIP_WARMUP:
            return 1.0
        limit = self.ordered[len(self.ordered) * percentile // 100]
        if norm <= limit:
            return 1.0
        for g in grads:
            g.mul_(limit / norm)
        return limit / norm
