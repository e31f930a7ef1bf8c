"""``dana``: momentum SGD kept under staleness, one momentum per learner and the weights a look-ahead (DANA-Zero:
Hakimi, Barkai, Gabel, Schuster, "Taming Momentum in a Distributed Asynchronous Environment", 2019). Plain torch.

Heavy-ball momentum with one buffer for every learner's gradients turns unstable under a delay of τ updates once
step × curvature exceeds about π/(2τ + 1) (the ``momentum`` rule therefore switches it off and pays with the
curvatures between that edge and the synchronous run's, which ``clip`` holds). DANA keeps a buffer v_i per learner
and hands every learner the point the weights are about to reach, θ − η·β·Σ_j v_j: each learner's next update moves
them by its momentum part η·β·v_j before anything else, so a gradient taken there is stale only by the other
learners' gradient parts, not by the momentum that dominates a step. Kept as that look-ahead point Θ itself (as
Bengio's form of Nesterov's momentum), learner i's update is v_i ← β·v_i + g, Θ ← Θ − η·(g + β·v_i): Nesterov's
step of torch's SGD on learner i's own buffer. So the server's weights stay the weights it hands out, and the
optimizer's own step does the arithmetic (weight decay, foreach, maximize as it does them). The cost: a copy of the
server's part of the weights per learner, in memory and in every checkpoint. A learner that rejoins goes on with its
buffer.

An update of c gradients (n-softsync) steps on the mean of its learners' buffers with their mean gradient ḡ
(torch's step adds the weight decay to it), and each of them then holds β·v_i + ḡ: Θ moves as the c learners'
own steps would together, only the part of ḡ each holds is shared. The buffers live in the rules' running means
(``rules_states``, under ``momentum_<learner>``), so checkpoints keep them, cut as the server's parts. With a rate of
lr·c/λ per update the learners' buffers together move λ/c updates as far as the synchronous run's one step.

With ``overlap`` a learner computes its next gradient before the reply to its last push comes: on weights without
its own last update, the momentum-dominated step the look-ahead exists to hand out. :class:`StepAhead` takes an
estimate of that step on the learner's weights while the push is in flight, from an estimate of its buffer on the
server, at the rate the server applied to its last push; the reply replaces them with the server's at the next push.
"""

from typing import Any, Optional, Sequence

import torch
from torch import Tensor
from torch.optim import SGD, Optimizer
from torch.optim.sgd import sgd


def keeps_momentum(group: dict[str, Any]) -> bool:
    """Whether ``dana`` keeps the momentum of this parameter group (its learner's hyper-parameters): a momentum,
    and no dampening (Nesterov's form is the look-ahead only without it)."""
    return bool(group.get("momentum", 0)) and not group.get("dampening", 0)


def _buffer_key(learner: int) -> str:
    return f"momentum_{learner}"


def step_with_learner_momenta(
    optimizer: Optimizer,
    params: Sequence[Tensor],
    states: Sequence[dict[str, Tensor]],
    learners: Sequence[int],
) -> None:
    """``optimizer.step()`` (its groups set to Nesterov's momentum where ``keeps_momentum``) on the buffers of
    ``learners``, whose gradients this update sums (a learner twice if two of its gradients are in it; never one
    refused or dropped): per parameter of ``params`` (the optimizer's, in its order, with ``states`` their rules'
    running means) its learner's own, or for several their mean, each of them then holding β·v_i + ḡ once per
    gradient of its in the update."""
    position = {id(p): i for i, p in enumerate(params)}
    lent: list[tuple[dict[str, Tensor], Tensor, Tensor, float]] = []  # several learners: (state, param, mean, β)
    for group in optimizer.param_groups:
        if not (group.get("nesterov") and keeps_momentum(group)):
            continue
        for p in group["params"]:
            if p.grad is None or id(p) not in position:
                continue
            state = states[position[id(p)]]
            own = [state[_buffer_key(i)] for i in learners if _buffer_key(i) in state]  # none yet: zero
            if len(learners) == 1:
                # the learner's buffer itself: torch's step updates it in place (none yet: torch makes it)
                optimizer.state[p]["momentum_buffer"] = own[0] if own else None
                lent.append((state, p, p.grad, 0.0))
            else:
                mean = sum(own[1:], own[0].clone()).div_(len(learners)) if own else p.grad.new_zeros(p.shape)
                optimizer.state[p]["momentum_buffer"] = mean.clone()
                lent.append((state, p, mean, group["momentum"]))
    _step_in_place(optimizer)
    for state, p, mean, beta in lent:
        buffer = optimizer.state[p]["momentum_buffer"]
        if len(learners) == 1:
            state[_buffer_key(learners[0])] = buffer
            continue
        gradient = buffer - mean.mul_(beta)  # ḡ with its weight decay: the step's buffer is β·mean + ḡ
        for i in learners:
            own_buffer = state.get(_buffer_key(i))
            state[_buffer_key(i)] = gradient.clone() if own_buffer is None else own_buffer.mul_(beta).add_(gradient)


def _step_in_place(optimizer: Optimizer) -> None:
    """``optimizer.step()``; torch's SGD by its foreach path, which adds β·v to the gradient in place (the server's
    own, which nothing reads after the step), where its single-tensor path makes g + β·v a new tensor: past 32 MB
    one fresh from the OS each step, a page fault every 4 KiB (37 ms against 10 ms for 10 M elements). The same
    arithmetic, element by element, for float32 and float64 parameters; float16 and bfloat16, which the foreach path
    rounds otherwise, take the single-tensor one."""
    exact = all(p.dtype in (torch.float32, torch.float64) for g in optimizer.param_groups for p in g["params"])
    if type(optimizer) is not SGD or not exact:
        optimizer.step()
        return
    chosen = [group.get("foreach") for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["foreach"] = True
    try:
        optimizer.step()
    finally:
        for group, foreach in zip(optimizer.param_groups, chosen):
            group["foreach"] = foreach


class StepAhead:
    """``overlap`` with ``dana`` (learner side): after its push goes, the learner takes an estimate of its own
    gradient's step on the weights it holds, as the server's update takes it (Nesterov's torch SGD step on the
    learner's buffer, v ← β·v + g), at the rate the server applied to its optimizer's last push: the reply's
    ``lr_scale`` over the ``per_update`` gradients an update averages. The buffers, one per optimizer and parameter,
    estimate the server's: they start once a reply says the gradients are stale (one push after dana starts: the
    first stale gradient's part is missed), a push the server dropped or refused is taken out again, and they miss
    what only the server sees (``clip``, softsync's shared part, compression), which the reply's weights replace at
    the next push. Groups dana does not keep momentum for are left as they are. ``undo``: the server may drop a push
    (``max_staleness``), so each step keeps the buffers it changed until its reply says (a copy per push)."""

    def __init__(self, per_update: int, undo: bool) -> None:
        self.per_update = per_update
        self.undo = undo
        self.shares: dict[int, float] = {}  # optimizer -> the rate its last reply applied, over c
        self.stale: set[int] = set()  # the optimizers whose replies said σ > 0: dana's updates have started
        self.momenta: dict[tuple[int, int], Tensor] = {}  # (optimizer, id of the parameter) -> its buffer
        self._undo: dict[int, dict[tuple[int, int], Optional[Tensor]]] = {}  # optimizer -> buffers before its step

    def settled(self, index: int, status: str, staleness: int, lr_scale: float) -> None:
        """The reply to optimizer ``index``'s last push: what became of it, its σ, and the rate applied."""
        undo = self._undo.pop(index, {})
        if status in ("dropped", "rejected", "late"):  # not in the server's buffer: not in its estimate either
            for key, buffer in undo.items():
                if buffer is None:
                    self.momenta.pop(key, None)
                else:
                    self.momenta[key] = buffer
            return
        if staleness > 0:
            self.stale.add(index)
        self.shares[index] = lr_scale / self.per_update

    @torch.no_grad()
    def step(self, index: int, optimizer: Optimizer, grads: dict[int, Tensor]) -> None:
        """The step of optimizer ``index`` (``optimizer``) by ``grads`` (id of the parameter -> its dense gradient;
        one without a gradient does not move), if it is SGD and its pushes are stale."""
        if index not in self.stale or not isinstance(optimizer, SGD):
            return
        undo = self._undo[index] = {}
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if id(p) in grads]
            if not keeps_momentum(group) or not params:
                continue
            keys = [(index, id(p)) for p in params]
            buffers: list[Any] = [self.momenta.get(key) for key in keys]
            if self.undo:
                undo.update((key, None if buffer is None else buffer.clone()) for key, buffer in zip(keys, buffers))
            sgd(
                params,
                [grads[id(p)] for p in params],
                buffers,
                weight_decay=group["weight_decay"],
                momentum=group["momentum"],
                lr=float(group["lr"]) * self.shares[index],
                dampening=0.0,
                nesterov=True,
                maximize=group["maximize"],
                foreach=False,  # the one that leaves the gradients as they are (the learner's, not a copy)
            )
            self.momenta.update(zip(keys, buffers))
