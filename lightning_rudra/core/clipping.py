"""Gradient clipping on the server: the gradient an update applies is clipped, as DDP clips the averaged gradient
(clipping each learner's gradient before the push, then averaging, is another update). Plain torch.

A learner asks for it with a push: the clippings Lightning would apply to that step's gradient, in their order
(``gradient_clip_val`` and ``gradient_clip_algorithm``, or each of the module's own ``clip_gradients`` calls); the
server clips the combined gradient of that optimizer's update (:func:`clip`) before its optimizer steps: after
averaging and compensation, as DDP clips before its optimizer steps. Under async an update holds one gradient:
clipping it there is what one learner alone would do.

By value, every element is clipped on its own: exact at any cut. By norm, the norm is over all of an optimizer's
parameters, which several servers may each hold a part of (:attr:`Clipping.servers`); the clip then takes the norm
over all of them (:class:`GlobalNorm`):

- hardsync: every server's round averages the same gradients; each sends the squared norm of its part to the others
  (:attr:`GlobalNorm.partial`, the server process) and scales its part once it has them all; every push of a round
  must ask for the same clippings (:func:`check_same`);
- an update of one gradient (async, softsync with c = 1): the learner knows its gradient's norm over every part and
  sends it (:attr:`Clipping.norm`); each server scales its part by the same factor. The norm is of the gradient as
  pushed, before the server's delay compensation (``dc``, ``gap``) changes it, where one server clips after it;
- softsync with c > 1: servers may average different gradients into their k-th update, so there is no one norm
  without waiting for each other: refused (:func:`refuse_softsync`).
"""

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import Tensor

from lightning_rudra.core.errors import ConfigurationError

CLIP_ALGORITHMS = ("norm", "value")
_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s, for the same factor


@dataclass(frozen=True)
class Clipping:
    """Clip an update's gradient: its norm over the optimizer's parameters to at most ``value`` (``"norm"``, as
    ``torch.nn.utils.clip_grad_norm_``), or each element to ``[-value, value]`` (``"value"``). ``servers``: by norm,
    the servers that hold a part of the optimizer, where they are several (the norm is over every part); ``norm``:
    then, the norm of the pushing learner's gradient over every part, as this clipping sees it (after the
    clippings before it)."""

    value: float
    algorithm: str = "norm"
    servers: tuple[int, ...] = ()
    norm: Optional[float] = None

    def __post_init__(self) -> None:
        check(self)

    @property
    def global_norm(self) -> bool:
        """By norm over several servers' parts."""
        return self.algorithm == "norm" and len(self.servers) > 1


def check(clipping: Any) -> None:
    """A clipping request as it arrives (unpickling skips ``__post_init__``): refused by name if it is not one."""
    if not isinstance(clipping, Clipping):
        raise ValueError(f"clipping={clipping!r} is not valid: expected a Clipping(value, algorithm).")
    value = getattr(clipping, "value", None)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"gradient clipping value {value!r} is not valid: expected a finite number > 0.")
    algorithm = getattr(clipping, "algorithm", None)
    if not isinstance(algorithm, str) or algorithm not in CLIP_ALGORITHMS:
        raise ValueError(
            f"gradient clipping algorithm {algorithm!r} is not supported: expected one of "
            f"{', '.join(map(repr, CLIP_ALGORITHMS))}."
        )
    servers = getattr(clipping, "servers", None)
    if not isinstance(servers, tuple) or not all(is_server(s) for s in servers):
        raise ValueError(f"gradient clipping servers {servers!r} are not valid: expected a tuple of server indices.")
    norm = getattr(clipping, "norm", None)
    if norm is not None and (isinstance(norm, bool) or not isinstance(norm, (int, float)) or not norm >= 0):
        raise ValueError(f"gradient norm {norm!r} is not valid: expected None or a number >= 0.")


def is_server(server: Any) -> bool:
    """A server's index: an int >= 0, not a bool (which Python counts as 0 or 1)."""
    return isinstance(server, int) and not isinstance(server, bool) and server >= 0


def check_all(clippings: Any) -> tuple[Clipping, ...]:
    """A push's clippings as they arrive: a tuple of :class:`Clipping`, at most one of them by norm over several
    servers (:func:`check_servers`)."""
    if not isinstance(clippings, tuple):
        raise ValueError(f"clipping={clippings!r} is not valid: expected a tuple of Clipping(value, algorithm).")
    for clipping in clippings:
        check(clipping)
    return clippings


def check_servers(clippings: Sequence[Clipping], servers: int, optimizer: int) -> None:
    """Across ``servers`` servers, the servers exchange one norm per update: one clipping by norm per step."""
    by_norm = [c for c in clippings if c.algorithm == "norm"]
    if servers > 1 and len(by_norm) > 1:
        raise ConfigurationError(
            f"{len(by_norm)} gradient clippings by norm in one step (gradient_clip_val="
            f"{', '.join(str(c.value) for c in by_norm)}) are not supported when the parameters of optimizer "
            f"{optimizer} are cut between {servers} parameter servers: they exchange one norm per update. Clip by "
            "norm once per step, or use RudraStrategy(num_servers=1)."
        )


def check_same(clippings: Sequence[Clipping], learner: int, first: Sequence[Clipping], by: int, optimizer: int) -> None:
    """Hardsync: ``learner``'s push asks for ``clippings``, the round's first push (``by``) for ``first``. One update,
    one clipping: the newest push's request would hold, and push order differs per server."""
    if _requests(clippings) != _requests(first):
        raise ValueError(
            f"learner {learner} asked for {describe(clippings)} of optimizer {optimizer}'s gradient, and learner {by} "
            f"for {describe(first)} in the same hardsync round: the round averages every learner's gradient into one "
            "update, clipped one way. Ask for the same clipping on every learner (the same gradient_clip_val and "
            "gradient_clip_algorithm, the same clip_gradients calls in every step)."
        )


def describe(clippings: Sequence[Clipping]) -> str:
    """Clippings in words: ``clipping by norm to 1.0, then by value to 0.5``, or ``no clipping``."""
    if not clippings:
        return "no clipping"
    return "clipping " + ", then ".join(f"by {c.algorithm} to {c.value}" for c in clippings)


def _requests(clippings: Sequence[Clipping]) -> tuple[Clipping, ...]:
    """What the clippings ask, without the learner's norm of its own gradient."""
    return tuple(replace(c, norm=None) for c in clippings)


def across_servers(
    clippings: Sequence[Clipping], servers: Sequence[int], grads: Sequence[Tensor], optimizer: int, norm: bool = True
) -> tuple[Clipping, ...]:
    """A learner's clippings of its gradient ``grads`` of ``optimizer`` (every part), as it pushes them to the
    ``servers`` that hold a part: where they are several, a clipping by norm names them, with (``norm``: where an
    update applies this gradient alone, and it is finite) the norm of ``grads`` as that clipping sees it (after the
    clippings by value before it)."""
    if len(servers) <= 1 or not any(c.algorithm == "norm" for c in clippings):
        return tuple(clippings)
    check_servers(clippings, len(servers), optimizer)
    told: list[Clipping] = []
    seen = list(grads)
    for clipping in clippings:
        if clipping.algorithm == "value":  # a copy: the learner's gradient stays as it is
            seen = [g.clamp(-clipping.value, clipping.value) for g in seen]
            told.append(clipping)
        else:
            told.append(replace(clipping, servers=tuple(servers), norm=math.sqrt(squares(seen)) if norm else None))
    return tuple(told)


def refuse_softsync(value: float, optimizer: int, servers: int, c: int, n: int, learners: int) -> None:
    """Softsync with c > 1 gradients per update: each server may average other gradients into its k-th update,
    so clipping by norm over the servers' parts has no one norm."""
    raise ConfigurationError(
        f"gradient clipping by norm (gradient_clip_val={value}) is not supported with softsync averaging c={c} "
        f"gradients per update (λ={learners}, n={n}) when the parameters of optimizer {optimizer} are cut between "
        f"{servers} parameter servers: each server may average different gradients into an update, so there is no "
        f"one norm. Use RudraStrategy(num_servers=1), or n={learners} (c=1), or protocol='hardsync' or 'async', or "
        "clip by value (Trainer(gradient_clip_algorithm='value'), or self.clip_gradients(..., "
        "gradient_clip_algorithm='value'))."
    )


def squares(tensors: Sequence[Tensor]) -> float:
    """The sum of the squares of every element of ``tensors`` (a squared norm), in float."""
    return float(sum(float(t.detach().float().pow(2).sum()) for t in tensors))


def squared_norm(params: Sequence[Tensor]) -> float:
    """The squared norm of the gradients of ``params`` (this server's part of an update's gradient)."""
    return squares([p.grad for p in params if p.grad is not None])


@dataclass(frozen=True)
class GlobalNorm:
    """A hardsync round whose clipping by norm waits for the other servers' parts of the norm: the position of
    that clipping among the update's, the servers that hold a part, this server's squared norm and the round."""

    step: int
    servers: tuple[int, ...]
    partial: float
    round: int


def global_norm_step(clippings: Sequence[Clipping]) -> Optional[int]:
    """The position of the clipping by norm over several servers, if any (:func:`check_servers`: at most one)."""
    return next((i for i, c in enumerate(clippings) if c.global_norm), None)


def clip(
    params: Sequence[Tensor],
    clippings: Sequence[Clipping],
    scale: float = 1.0,
    total_norm: Optional[float] = None,
    sync: Optional[Callable[[float], float]] = None,
) -> None:
    """Clip the gradients of ``params`` (one optimizer's, as the server holds them) in place, by each of
    ``clippings`` in turn, as Lightning applies successive ``clip_gradients`` calls. ``scale``: the mean factor the
    update's gradients were scaled by (``lr_modulation="per_gradient"``); the limit is scaled alike, so that a stale
    gradient is clipped as its learner would have clipped it and still modulated (exact for one gradient per update).
    A clipping by norm over several servers takes ``total_norm`` (the norm of the update's gradient over every part,
    exchanged by the servers) or else the learner's :attr:`Clipping.norm`. ``sync``: where a clipping by norm is by
    a synchronous update's norm (:class:`SyncNorm`), what it returns for this update given this server's gradient's
    norm, taken once, at the first clipping by norm."""
    grads = [p for p in params if p.grad is not None]
    if not grads:  # this server holds none of the optimizer's parameters, or none got a gradient
        return
    ratio: Optional[float] = None
    for clipping in clippings:
        if clipping.algorithm == "value":
            torch.nn.utils.clip_grad_value_(grads, clipping.value * scale)
            continue
        own = None  # this server's gradient's norm, where the rule took it for this clipping
        if ratio is None:
            ratio = 1.0
            if sync is not None:
                own = norm64([p.grad for p in grads])
                ratio = sync(own)
        if not clipping.global_norm and ratio == 1.0:
            torch.nn.utils.clip_grad_norm_(grads, clipping.value * scale)
            continue
        if not clipping.global_norm:  # of this server's gradient, as scaled
            own = norm64([p.grad for p in grads]) if own is None else own
            factor = clipping.value * scale / (own * ratio + _EPS)
        elif total_norm is not None:  # of the update's gradient, as scaled
            factor = clipping.value * scale / (total_norm + _EPS)
        else:  # of the learner's gradient, before it was scaled: the same factor
            assert clipping.norm is not None, "the learner sends its gradient's norm with a clipping by norm"
            factor = clipping.value / (clipping.norm * ratio + _EPS)
        if factor < 1.0:
            for p in grads:
                p.grad.detach().mul_(factor)  # type: ignore[union-attr]  # grads: those with a gradient


# elements per piece of a float64 norm: the float64 copy of a piece stays in the cache, where the copy of a whole
# 5 M-element tensor took 23 ms against 4 ms in pieces (its 40 MB fresh from the OS, a page fault every 4 KiB)
NORM_PIECE = 1 << 18


def norm64(tensors: Iterable[Optional[Tensor]]) -> float:
    """The norm of dense ``tensors`` together, in float64 (a finite float32 gradient's norm cannot overflow), a piece
    of ``NORM_PIECE`` elements at a time."""
    norms = [
        torch.linalg.vector_norm(piece, dtype=torch.float64)
        for t in tensors
        if t is not None
        for piece in ((t.detach(),) if t.numel() <= NORM_PIECE else t.detach().reshape(-1).split(NORM_PIECE))
    ]
    return torch.linalg.vector_norm(torch.stack(norms)).item() if norms else 0.0


class SyncNorm:
    """``syncnorm``: a stale protocol's update of c < λ gradients, clipped by norm, is clipped by the norm of the
    synchronous update it stands for. Under the ``momentum`` rule λ/c such updates move as far as one synchronous
    update (its rate is scaled by c/λ), and a synchronous update clips the mean of λ gradients. One update's own
    gradient has the noise of c gradients: its norm is larger, so its own norm clips it more, and most where the
    noise dominates (small μ, large λ); the sum of λ/c such updates then moves less than the synchronous update,
    along the mean of unit vectors instead of the unit vector of the mean.

    The synchronous update's norm is estimated by a running mean m of the updates' gradients (this server's part of
    one optimizer's), m ← (1 − α)·m + α·g with α = 2c/(λ + c): its noise is that of a mean of λ gradients (an
    exponential mean of weight α holds α/(2 − α) of one term's variance). The update is clipped as if its norm were
    |g|·|m|/|g| = |m|, so a gradient whose norm the noise makes large is scaled less; never scaled up (a clipping
    only shrinks). The ratio |m|/|g| is held within [α, 1]: at least α (m holds α·g, unless older gradients cancel
    it), so one update moves at most (c/λ)/α = (λ + c)/(2λ) ≤ 1 of the synchronous update's step at the limit; at
    most 1, so the rule only ever clips less than the update's own norm would (a spike's share of m, or a mean that
    lags shrinking gradients, cannot hold the next updates back). With several servers, each scales by its part's
    |m|/|g| the learner's norm over every part (a per-part estimate, as ``clip``'s). m starts at the first gradient
    (no change until it has seen others), in the gradient's dtype or float32 if narrower; a gradient that is zero
    or not finite is not folded in and is clipped by its own norm; a mean that overflows starts again. m is not
    saved in checkpoints."""

    def __init__(self) -> None:
        self.means: dict[int, Tensor] = {}

    def ratio(self, params: Sequence[Tensor], alpha: float, norm: float) -> float:
        """Fold the gradients of ``params`` (one update's, of norm ``norm``) into the running mean with weight
        ``alpha``; returns |m| / |g| over the parameters that have a gradient, held within [``alpha``, 1]: where the
        mean cancels (gradients that flip sign, as in an oscillation clipping is there to stop) the update is still
        clipped as if m held only its α share of this gradient, and where the mean is larger than the gradient (it
        lags gradients that shrink, or holds a spike's share) the update is clipped by its own norm, as without the
        rule."""
        grads = {i: p.grad.detach() for i, p in enumerate(params) if p.grad is not None}
        if norm == 0 or not math.isfinite(norm):
            return 1.0
        for i, grad in grads.items():
            mean = self.means.get(i)
            # float64 gradients keep a float64 mean: a float32 one could overflow where they do not
            wide = grad.to(torch.promote_types(grad.dtype, torch.float32))
            if mean is None or mean.dtype != wide.dtype or mean.shape != grad.shape:
                self.means[i] = wide.clone()
            else:
                mean.mul_(1 - alpha).add_(wide, alpha=alpha)
        mean_norm = norm64(self.means[i] for i in grads)
        if not math.isfinite(mean_norm):  # the mean overflowed: start again from this gradient
            for i in grads:
                del self.means[i]
            return self.ratio(params, alpha, norm)
        return min(max(mean_norm / norm, alpha), 1.0)
