"""λ virtual learners in one process, under the real protocol: the paper's scale (λ = 30) on one machine.

:class:`SimulatedClient` stands where a learner's RPC client stands (:class:`~lightning_rudra.learner.learner.Learner`
uses it unchanged) and serves every virtual learner from an in-process
:class:`~lightning_rudra.core.protocol.Server`, the same one the parameter server process runs. Each virtual learner
holds the weights it last received and their timestamp, so a gradient is computed from exactly the weights a
real learner would hold when it pushes. :class:`SimulatedSampler` deals every learner the batches its own
DistributedSampler part would give it, in the order the timing model (:mod:`lightning_rudra.core.timing`) says
they reach the server, and :class:`LearnerSchedules` keeps every learner's own LR schedule. No Lightning here.
"""

import copy
from collections import deque
from typing import AbstractSet, Any, Callable, Iterator, Optional, Sequence

from torch import Tensor
from torch.futures import Future
from torch.optim import Optimizer
from torch.utils.data import DistributedSampler, Sampler

from lightning_rudra.core.compression import WeightDeltas
from lightning_rudra.core.protocol import Server
from lightning_rudra.core.update import Push, PushReply
from lightning_rudra.core.registration import Registration
from lightning_rudra.core.stats import Stats
from lightning_rudra.core.weights import Snapshot
from lightning_rudra.core.rounds_order import RoundsStart, RoundStep, rounds_order
from lightning_rudra.core.timing import TimingModel, push_order


class SimulatedClient:
    """The calls a :class:`Learner` makes (:class:`~lightning_rudra.learner.server_client.ServerClient`), answered
    for the virtual learner whose step runs now (:meth:`switch`). Memory: at most one copy of the weights per
    distinct timestamp the learners hold (λ + 1)."""

    rank = 0  # the one process is Lightning's rank 0: it registers the model and restores checkpoints

    def __init__(self, num_learners: int) -> None:
        self.num_learners = num_learners
        self.learner = 0  # the virtual learner whose step runs now
        self.timestamp = 0  # of the weights it holds
        self.server: Optional[Server] = None
        self._held = [0] * num_learners  # per learner, the clock of the weights it holds
        self._snapshots: dict[int, tuple[list[Tensor], list[Tensor]]] = {}  # clock -> flat weights and buffers
        self._parked: dict[int, list[int]] = {}  # per optimizer: learners waiting for the round to close
        self._waits = False  # batchsync: the next push's reply waits for its round (RoundStep.waits)
        self._loaded: Optional[int] = None  # the clock of the weights in the module, while nothing changed them
        # compression: (the server's, the learners') records of the weights each learner holds, sent as differences
        self._deltas: Optional[tuple[WeightDeltas, WeightDeltas]] = None

    def register(self, registration: Registration) -> None:
        """The in-process server, of the ``registration``'s model (its weights in this process: no shared memory;
        no process rejoins a simulated run: no ``module``).

        Args:
            registration: the whole model, as learner 0 registers it.
        """
        r = registration
        if r.config.num_learners != self.num_learners:
            raise ValueError(
                f"a protocol for λ={r.config.num_learners} learners cannot run {self.num_learners} simulated learners."
            )
        self.server = Server(r.config, r.params, r.buffers, r.specs, r.stats)
        self.server.load_optimizer_states(r.optimizer_states or [])
        self._held = [self.server.clock] * self.num_learners

    def attached(self, mapped: bool) -> None:
        """Nothing to map: the weights are in this process."""

    def weights_as_deltas(self, compression: str) -> None:
        """As a real learner's, each learner's weights come back as bfloat16 differences from those it holds
        (:meth:`LearnerClient.weights_as_deltas <lightning_rudra.learner.client.LearnerClient.weights_as_deltas>`):
        each keeps its own copy, which its steps then start from."""
        self._deltas = (WeightDeltas(compression), WeightDeltas(compression))

    def switch(self, learner: int) -> Optional[tuple[list[Tensor], list[Tensor]]]:
        """The next step is ``learner``'s: the weights it holds, for the module to load first (None: the module
        holds them already). Either way the step about to run changes the module (buffers in its forward, a push's
        reply), so the next switch cannot take it for untouched."""
        if learner not in range(self.num_learners):
            raise ValueError(f"learner {learner!r} is not one of the {self.num_learners} simulated learners.")
        server = self._server()
        self.learner = learner
        self.timestamp = self._held[learner]
        stale = self._loaded != self.timestamp or self._deltas is not None  # copies of one clock differ
        self._loaded = None
        server.stats.batches[learner] = server.stats.batches.get(learner, 0) + 1
        return self._held_weights(learner) if stale else None

    def pull(self) -> tuple[list[Tensor], list[Tensor]]:
        """The newest weights (validation, the start of training); the next :meth:`switch` restores a learner's."""
        self.timestamp = self._loaded = self._server().clock
        return self._weights(self.timestamp)

    def push(self, push: Push) -> Future:
        """The current learner's gradient. Its reply holds the newest weights, except inside a hardsync round:
        there the learner keeps its weights until the round's last gradient arrives (then all in it get them).

        Args:
            push: the gradient of the learner whose step runs now (:meth:`switch`), in full.

        Returns:
            a future already resolved with the :class:`PushReply`.
        """
        assert push.grads is not None, "no shared memory to read a gradient from: a Learner sends it in the push"
        assert not push.members and not push.refused, "simulated learners push alone: no node-local aggregation"
        optimizer = push.optimizer
        server = self._server()
        hardsync = server.config.protocol == "hardsync"
        if hardsync and any(self.learner in parked for parked in self._parked.values()):
            raise RuntimeError(
                f"simulated learner {self.learner} stepped an optimizer again in the same batch while its previous "
                "push waits for the hardsync round to close. A real learner would wait for the round in between; a "
                "simulated one trains each batch in one go, so more than one optimizer step per batch (several "
                "optimizers, manual optimization) cannot be simulated under hardsync. Use softsync or async, or real "
                "learners (devices=λ)."
            )
        result = server.push(push)
        received = []
        paced = self._waits and result.status == "accepted"
        if (hardsync or paced) and not result.closed and result.status != "late":  # a late push: answered at once
            self._parked.setdefault(optimizer, []).append(self.learner)
        else:
            received = [self.learner] + (self._parked.pop(optimizer, []) if result.closed else [])
            self._hand_newest(received)
        clock = self._held[self.learner]
        update = server.last_updates[optimizer]
        reply: Future = Future()
        reply.set_result(
            PushReply(
                result.status,
                result.staleness,
                update.lr_scale if update is not None else 1.0,
                *self._held_weights(self.learner),
                clock,
            )
        )
        return reply

    def _hand_newest(self, learners: Sequence[int]) -> None:
        """``learners`` get the newest weights (their replies)."""
        server = self._server()
        for learner in learners:
            self._held[learner] = server.clock
            if self._deltas is not None:
                server_side, learner_side = self._deltas
                sent = server_side.encode(learner, learner_side.count(learner), self._weights(server.clock)[0])
                learner_side.decode(sent, learner)

    def meet(self, away: AbstractSet[int]) -> None:
        """Backup learners: the learners of ``away`` are out of batches (at a real run's collective), so a round
        that waits only for them closes (:meth:`Server.meet`), and its learners get their replies."""
        for optimizer in self._server().meet(away):
            self._hand_newest(self._parked.pop(optimizer, []))

    def end_epoch(self) -> None:
        """batchsync and backup learners: every learner is out of batches (real ones meet at the epoch's end), so
        no reply waits for a round any more: a backup round closes, batchsync's waiting replies are answered."""
        self.meet(set(range(self.num_learners)))
        self._hand_newest(self._parked.pop(0, []))

    def step(self, step: RoundStep) -> None:
        """batchsync and backup learners: the server as it is when ``step``'s push comes (:func:`rounds_order`):
        who is out of batches, whose waiting replies were answered meanwhile, whether this one's will wait."""
        self.meet(step.away)
        if step.again:  # as the shared epoch counts the batches it deals again
            self._server().stats.redealt += 1
        if step.released:
            parked = self._parked.get(0, [])
            self._parked[0] = [learner for learner in parked if learner not in step.released]
            self._hand_newest([learner for learner in parked if learner in step.released])
        self._waits = step.waits

    def rounds_start(self) -> RoundsStart:
        """The server as an epoch of batchsync or backup learners starts (:func:`rounds_order`)."""
        server = self._server()
        batchsync = server.config.protocol == "batchsync"
        received, learners = server.open_update()
        return RoundsStart(
            k=server.config.gradients_per_update if batchsync else 0,
            backup=server.config.backup,
            held=list(self._held),
            clock=server.clock,
            received=received if batchsync else 0,
            in_round=frozenset() if batchsync else learners,
        )

    def receive(self, pushed: Future) -> PushReply:
        reply: PushReply = pushed.wait()
        self.timestamp = self._loaded = reply.clock  # the Learner loads these weights into the module now
        return reply

    def finish(self) -> Future:
        """Every learner stops: gradients still waiting for a softsync update are applied. For
        :meth:`final_weights`."""
        server = self._server()
        for learner in sorted(server.active):
            server.finish(learner)
        self._parked = {}
        self._held = [server.clock] * self.num_learners
        finished: Future = Future()
        finished.set_result(server.clock)
        return finished

    def final_weights(self, finished: Future) -> tuple[list[Tensor], list[Tensor]]:
        """The newest weights."""
        self.timestamp = self._loaded = finished.wait()
        return self._weights(self.timestamp)

    def stats(self) -> Stats:
        return self._server().stats

    def snapshot(self) -> Snapshot:
        server = self._server()
        params, buffers, clock = server.pull()
        self.timestamp = self._loaded = clock  # the Learner loads these into the module now
        states = [server.optimizer_state(i) for i in range(len(server.optimizers))]
        return Snapshot(params, buffers, clock, states, server.weights_stats())

    def optimizer_state(self, optimizer: int) -> dict[str, Any]:
        return self._server().optimizer_state(optimizer)

    def load_optimizer_state(self, optimizer: int, state: dict[str, Any]) -> None:
        self._server().load_optimizer_state(optimizer, state)

    def _server(self) -> Server:
        if self.server is None:
            raise RuntimeError("the simulated parameter server holds no weights yet: the model was not registered")
        return self.server

    def _held_weights(self, learner: int) -> tuple[list[Tensor], list[Tensor]]:
        """The weights ``learner`` holds: of its clock, or its own copy of them (compression)."""
        params, buffers = self._weights(self._held[learner])
        if self._deltas is not None and learner in self._deltas[1].held:
            params = self._deltas[1].held[learner][1]
        return params, buffers

    def _weights(self, clock: int) -> tuple[list[Tensor], list[Tensor]]:
        """The weights of ``clock`` (the newest, or one a learner holds); copies no learner holds are dropped."""
        if clock not in self._snapshots:
            params, buffers, newest = self._server().pull()
            assert newest == clock, "only the newest weights can be handed out for the first time"
            self._snapshots[clock] = (params, buffers)
        held = set(self._held) | {clock}
        self._snapshots = {c: weights for c, weights in self._snapshots.items() if c in held}
        return self._snapshots[clock]


class SimulatedSampler(Sampler[list[int]]):
    """A batch sampler for the one process of a simulated run. Every epoch, learner r gets the batches of
    ``parts[r]`` (Lightning's DistributedSampler for rank r of λ: what a real learner of that rank reads), cut
    into ``batch_size`` as its DataLoader would, and the batches of all learners come in the order in which
    :func:`~lightning_rudra.timing.push_order` says they are pushed.

    ``learners`` holds the learner of every batch yielded and not yet trained on (Lightning and the DataLoader
    fetch ahead); :meth:`next_learner` takes the oldest. ``max_batches`` caps every learner's batches per epoch
    (``limit_train_batches``), ``budget`` its steps over the run (``max_steps``); ``taken`` counts the batches
    each learner took before this epoch (the server's statistics, restored with a checkpoint). Its length is
    one learner's batches per epoch, or, once ``whole``, every learner's.

    Under batchsync and backup learners (``rounds``: the client, whose server's state each epoch starts from), the
    learners draw from one pool of the epoch's batches instead, as real ones do from the shared epoch, in the
    order of :func:`~lightning_rudra.core.rounds_order.rounds_order`: a late gradient's batch is trained again, so
    an epoch has more steps than batches, which ``on_steps`` is told when the epoch starts.
    """

    def __init__(
        self,
        parts: Sequence[DistributedSampler],
        batch_size: int,
        drop_last: bool,
        protocol: str,
        timing: TimingModel,
        taken: Optional[dict[int, int]] = None,
    ) -> None:
        self.parts = list(parts)
        self.sampler = self  # where Lightning sets the epoch of a batch sampler (``batch_sampler.sampler``)
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.protocol = protocol
        self.timing = timing
        self.taken = taken or {}
        self.whole = False
        self.max_batches: Optional[int] = None
        self.budget: Optional[int] = None
        self.learners: deque[int] = deque()
        self.rounds: Optional[SimulatedClient] = None
        self.on_steps: Optional[Callable[[int], None]] = None
        self._steps: deque[RoundStep] = deque()

    def set_epoch(self, epoch: int) -> None:
        for part in self.parts:
            part.set_epoch(epoch)

    def batches_per_learner(self) -> int:
        full, rest = divmod(len(self.parts[0]), self.batch_size)
        batches = full + (1 if rest and not self.drop_last else 0)
        return batches if self.max_batches is None else min(batches, self.max_batches)

    def __len__(self) -> int:
        if self.rounds is not None:  # late gradients' batches are trained again: Lightning must look ahead
            raise TypeError("the steps of an epoch of batchsync or backup learners are not known in advance")
        return self.batches_per_learner() * (len(self.parts) if self.whole else 1)

    def __iter__(self) -> Iterator[list[int]]:
        if self.rounds is not None:
            yield from self._pooled(self.rounds)
            return
        per_learner = self.batches_per_learner()
        batches = [self._cut(list(part))[:per_learner] for part in self.parts]
        done = [self.taken.get(r, 0) for r in range(len(self.parts))]
        steps = [len(b) if self.budget is None else max(0, min(len(b), self.budget - d)) for b, d in zip(batches, done)]
        order = push_order(self.protocol, steps, self.timing, done)
        self.learners.clear()
        position = [0] * len(self.parts)
        for learner in order:
            self.learners.append(learner)
            yield batches[learner][position[learner]]
            position[learner] += 1

    def _pooled(self, client: SimulatedClient) -> Iterator[list[int]]:
        """The epoch of batchsync or backup learners: the shared epoch's pool (DistributedSampler's order over all
        learners, which their parts interleave), dealt as :func:`rounds_order` says."""
        learners = len(self.parts)
        parts = [list(part) for part in self.parts]
        pool = self._cut([parts[i % learners][i // learners] for i in range(sum(map(len, parts)))])
        batches = min(len(pool), self.batches_per_learner() * learners)
        done = [self.taken.get(r, 0) for r in range(learners)]
        if self.budget is not None:
            batches = min(batches, max(0, self.budget * learners - sum(done)))
        steps = rounds_order(client.rounds_start(), batches, self.timing, done)
        if self.on_steps is not None:
            self.on_steps(len(steps))
        self.learners.clear()
        self._steps.clear()
        for step in steps:
            self.learners.append(step.learner)
            self._steps.append(step)
            yield pool[step.batch]

    def next_learner(self) -> int:
        """The learner of the next batch to train (under batchsync and backup learners the server first learns
        what happened since the step before: :meth:`SimulatedClient.step`)."""
        if self.rounds is not None:
            self.rounds.step(self._steps.popleft())
        return self.learners.popleft()

    def _cut(self, indices: list[int]) -> list[list[int]]:
        size = self.batch_size
        cut = [indices[i : i + size] for i in range(0, len(indices), size)]
        return cut[:-1] if cut and self.drop_last and len(cut[-1]) < size else cut


class LearnerSchedules:
    """Every simulated learner's own LR schedule, as each real learner steps its own schedulers: the state of
    ``schedulers`` and the hyper-parameters (what schedulers set) of every group of ``optimizers``. One learner's
    is in place at a time (:meth:`switch`); all start from the schedule as it is now."""

    def __init__(self, num_learners: int, schedulers: Sequence[Any], optimizers: Sequence[Optimizer]) -> None:
        self.schedulers = list(schedulers)
        self.optimizers = list(optimizers)
        self.learner = 0  # whose schedule is in place
        now = self._take()
        self.states = [copy.deepcopy(now) for _ in range(num_learners)]

    def switch(self, learner: int) -> None:
        """Puts ``learner``'s schedule in place, keeping the one in place until now."""
        if learner != self.learner:
            self.states[self.learner] = self._take()
            self._put(self.states[learner])
            self.learner = learner

    def each(self) -> Iterator[int]:
        """Every learner in turn, its schedule in place (to step all of them, at the end of an epoch); then the one
        in place before."""
        before = self.learner
        for learner in range(len(self.states)):
            self.switch(learner)
            yield learner
        self.switch(before)

    def _take(self) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
        return (
            [copy.deepcopy(scheduler.state_dict()) for scheduler in self.schedulers],
            [
                [{k: copy.deepcopy(v) for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
                for optimizer in self.optimizers
            ],
        )

    def _put(self, state: tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]) -> None:
        schedulers, optimizers = copy.deepcopy(state)
        for scheduler, saved in zip(self.schedulers, schedulers):
            scheduler.load_state_dict(saved)
        for optimizer, groups in zip(self.optimizers, optimizers):
            for group, saved in zip(optimizer.param_groups, groups):
                group.update(saved)
