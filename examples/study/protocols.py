"""Which protocol when learners straggle: simulated λ = 16 under shifted-exponential step times, every protocol.

    python -m examples.study.protocols --out docs/study/protocols            # add --resume to go on
    python -m examples.study.protocols --out docs/study/protocols --report-only   # findings.md and the plots

As the compensation study (:mod:`examples.study.compensation`, whose split, step counts, epoch times and model this
reuses): λ = 16 virtual learners in one process, driven against the package's own :class:`lightning_rudra.Server`,
MNIST-1D (4000 samples per seed, 20 % test, the last 10 % of the training samples for validation), μλ = 128,
momentum SGD (0.9) at rate ``LR``, every protocol with the strategy's default compensation (``DEFAULT_COMPENSATION``). Step
times: :class:`~lightning_rudra.timing.ShiftedExponential` (0.5 + an exponential of mean 0.5; Dutta et al.'s
straggler model), seeded per run; the server answers at once and communication costs nothing; every epoch starts
with all learners together.

The protocols (``PROTOCOLS``) and how their learners are driven, each by the server's own replies:

- hardsync, 4-softsync, async: :class:`~lightning_rudra.learner.simulation.SimulatedClient` (the simulated run's
  client, its replies parked until a hardsync round closes) in :func:`~lightning_rudra.timing.push_order`'s order;
- batchsync (K = λ) and hardsync with backup = 2: the same client, in
  :func:`~lightning_rudra.core.rounds_order.rounds_order`'s order (the epoch's batches one pool, a late gradient's
  batch trained again, replies parked by pacing or until the round closes, the learners out of batches away);
- SSP (4-softsync, ``max_staleness=4``, ``on_stale="block"``; 4 is ``min_blocking_staleness`` at λ = 16): an event
  loop of its own (:func:`ssp_epoch`): a learner whose push is held starts nothing until ``Server.release`` lets it
  go, and its reply then carries the newest weights; a learner out of batches waits at the epoch's end (away).

Where the order's assumptions and the server's statuses disagree (a batch of the pool applied other than once, a
push left held at an epoch's end, σ above the bound), the run counts it (``disagreements``).

Budget: hardsync trains ``EPOCHS`` epochs (its test error has nearly levelled off by then: the compensation study's
hardsync curves at this rate); every other protocol trains at least as many and until its simulated time reaches
hardsync's (at most ``3 × EPOCHS``), so both comparisons exist: at equal epochs and at equal simulated time.
One JSON line per run in ``<out>/runs.jsonl``; ``--resume`` skips the runs there; ``--report-only`` rewrites the
report (:mod:`examples.study.protocols_report`).
"""

import heapq
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from examples.mnist1d import MNIST1DClassifier
from examples.study.compensation import epoch_time, learner_steps, parse, read_rows, source
from examples.study.families import NUM_SAMPLES, mnist1d_splits
from lightning_rudra import ProtocolConfig
from lightning_rudra.core.compensation import DEFAULT_COMPENSATION
from lightning_rudra.core.optimizers import OptimizerSpec, hyperparameters
from lightning_rudra.core.registration import Registration
from lightning_rudra.core.rounds_order import rounds_order
from lightning_rudra.core.update import Push
from lightning_rudra.learner.simulation import SimulatedClient
from lightning_rudra.timing import ShiftedExponential, TimingModel, push_order

LEARNERS = 16
MU_LAMBDA = 128
EPOCHS = 12  # hardsync's (20 did not fit the time on a busy 2-core machine); the others go on to its time
LR = 0.2  # the rate the compensation study chose for momentum SGD's hardsync on its tuning seed's validation split
SEEDS = (0, 1, 2)
COMPENSATION = DEFAULT_COMPENSATION
PROTOCOLS: dict[str, dict[str, Any]] = {
    "hardsync": dict(protocol="hardsync"),
    "batchsync": dict(protocol="batchsync"),  # K = λ
    "backup": dict(protocol="hardsync", backup=2),
    "ssp": dict(protocol="softsync", n=4, max_staleness=4, on_stale="block"),
    "4-softsync": dict(protocol="softsync", n=4),
    "async": dict(protocol="async"),
}


def hardsync_times(seed: int, epochs: int, train_samples: int, learners: int = LEARNERS) -> list[float]:
    """Hardsync's simulated time at the end of every epoch (each round as long as its slowest step)."""
    timing, steps, now, times = ShiftedExponential(seed=seed), learner_steps(train_samples, learners), 0.0, []
    for epoch in range(epochs):
        now += epoch_time("hardsync", steps, timing, [s * epoch for s in steps])
        times.append(round(now, 3))
    return times


class Learners:
    """The model, the server behind a :class:`SimulatedClient`, and one step of a learner: its weights loaded,
    its gradient on ``batch`` pushed, its reply's weights loaded."""

    def __init__(self, name: str, seed: int, lr: float, learners: int) -> None:
        torch.manual_seed(seed)
        self.model = MNIST1DClassifier()
        self.params = list(self.model.parameters())
        opt = torch.optim.SGD(self.params, lr=lr, momentum=0.9)
        config = ProtocolConfig(learners, compensation=COMPENSATION, **PROTOCOLS[name])
        spec = OptimizerSpec.from_optimizer(opt, self.params)
        self.client = SimulatedClient(learners)
        self.client.register(Registration(config, [p.detach() for p in self.params], [], [spec]))
        self.server = self.client._server()
        self.hparams = [hyperparameters(group) for group in opt.param_groups]
        self.mask = torch.ones(len(self.params), dtype=torch.bool)
        # SSP's own loop (ssp_epoch): each learner's steps before the epoch, and the weights of its last reply
        self.ssp_done = [0] * learners
        self.ssp_held = [self.server.pull() for _ in range(learners)]

    def load(self, flat: torch.Tensor) -> None:
        torch.nn.utils.vector_to_parameters(flat, self.params)

    def gradient(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.model.zero_grad(set_to_none=False)
        F.cross_entropy(self.model(x), y).backward()
        return torch.cat([p.grad.reshape(-1) for p in self.params if p.grad is not None])

    def push(self, learner: int, timestamp: int, x: torch.Tensor, y: torch.Tensor) -> Push:
        return Push(learner, 0, [self.gradient(x, y)], self.mask, timestamp, self.hparams, [])

    def step(self, learner: int, x: torch.Tensor, y: torch.Tensor) -> str:
        loaded = self.client.switch(learner)
        if loaded is not None:
            self.load(loaded[0][0])
        reply = self.client.receive(self.client.push(self.push(learner, self.client.timestamp, x, y)))
        assert reply.params is not None
        self.load(reply.params[0])
        return reply.status

    def newest(self) -> torch.Tensor:
        """The newest weights, in the model (the client knows: the next step loads its learner's again)."""
        weights = self.client.pull()[0][0]
        self.load(weights)
        return weights


def ssp_epoch(
    learners: Learners, shards: Sequence[torch.Tensor], steps: Sequence[int], batch: Callable, timing: TimingModel
) -> tuple[float, int, list[int]]:
    """One epoch of SSP learners, event by event: (its simulated length, disagreements, steps per learner). Each
    learner computes from the weights of its last reply (``held``); a held push's learner waits for its release."""
    server, count = learners.server, len(steps)
    done = learners.ssp_done
    taken, away, disagreements = [0] * count, set[int](), 0
    events: list[tuple[float, int]] = []
    moment = 0.0

    def start(learner: int, at: float) -> None:
        if taken[learner] < steps[learner]:
            heapq.heappush(events, (at + timing.duration(learner, done[learner] + taken[learner]), learner))
        else:
            away.add(learner)

    def answer(learner: int, at: float) -> None:
        learners.ssp_held[learner] = server.pull()
        start(learner, at)

    server.release(frozenset())  # nobody waits at the collective any more
    for learner in range(count):
        start(learner, 0.0)
    while events:
        moment, learner = heapq.heappop(events)
        weights, _, timestamp = learners.ssp_held[learner]
        learners.load(weights[0])
        x, y = batch(shards[learner][taken[learner]])
        taken[learner] += 1
        if server.push(learners.push(learner, timestamp, x, y)).status != "held":
            answer(learner, moment)
        while released := server.release(frozenset(away)):
            for push, result in released:
                disagreements += isinstance(result, Exception)
                answer(push.learner, moment)
    disagreements += len(server.release(frozenset(range(count)))) + len(server.gate.held if server.gate else [])
    return moment, disagreements, taken


def train(name: str, seed: int, epochs: int, lr: float, learners: int = LEARNERS) -> dict[str, Any]:
    """One run: per epoch its test and validation errors, simulated time and counts (see the module's docstring)."""
    data = mnist1d_splits(seed, NUM_SAMPLES)
    (x, y), (x_val, y_val), (x_test, y_test) = data["train"], data["val"], data["test"]
    run = Learners(name, seed, lr, learners)
    server, client = run.server, run.client
    timing = ShiftedExponential(seed=seed)
    mu = MU_LAMBDA // learners
    budget = hardsync_times(seed, epochs, len(y), learners)[-1]
    pooled = server.config.discards_late
    done = [0] * learners
    order_rng = torch.Generator().manual_seed(seed)
    rows: dict[str, list] = {k: [] for k in ("errors", "val_errors", "times", "late", "held", "disagreements")}
    now, disagreements = 0.0, 0

    def error(x_eval: torch.Tensor, y_eval: torch.Tensor, finite: bool) -> float:
        with torch.no_grad():
            return round((run.model(x_eval).argmax(1) != y_eval).float().mean().item(), 4) if finite else 1.0

    def batch(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[indices], y[indices]

    while len(rows["errors"]) < 3 * epochs and (len(rows["errors"]) < epochs or round(now, 3) < budget):
        perm = torch.randperm(len(y), generator=order_rng)
        shards = perm.chunk(learners)
        steps = [len(shard) // mu for shard in shards]
        if name == "ssp":
            length, wrong, taken = ssp_epoch(run, [s.split(mu) for s in shards], steps, batch, timing)
            run.ssp_done = [d + t for d, t in zip(run.ssp_done, taken)]
            disagreements += wrong
        elif pooled:
            pool = perm[: sum(steps) * mu].split(mu)
            order = rounds_order(client.rounds_start(), len(pool), timing, done)
            statuses = []
            for step in order:
                client.step(step)
                statuses.append(run.step(step.learner, *batch(pool[step.batch])))
                done[step.learner] += 1
            client.end_epoch()
            disagreements += abs(sum(s != "late" for s in statuses) - len(pool))  # every batch applied once
            length = max(step.moment for step in order)
        else:
            position = [0] * learners
            for learner in push_order(server.config.protocol, steps, timing, done):
                run.step(learner, *batch(shards[learner][position[learner] * mu : (position[learner] + 1) * mu]))
                position[learner] += 1
            length = epoch_time(server.config.protocol, steps, timing, done)
            done = [d + s for d, s in zip(done, steps)]
        now += length  # (hardsync: exactly hardsync_times')
        weights = run.newest()
        finite = math.isfinite(weights.sum().item())
        rows["errors"].append(error(x_test, y_test, finite))
        rows["val_errors"].append(error(x_val, y_val, finite))
        rows["times"].append(round(now, 3))
        rows["late"].append(server.stats.late)
        rows["held"].append(server.stats.held)
        bound = server.config.max_staleness
        rows["disagreements"].append(disagreements + int(bound is not None and server.stats.max_staleness > bound))
    stats = server.stats
    return {
        **rows,
        "budget": budget,
        "train_samples": len(y),
        "gradients": stats.gradients,
        "dropped": stats.dropped,
        "updates": server.clock,
        "mean_staleness": round(stats.mean_staleness, 3),
        "max_staleness": stats.max_staleness,
    }


def runs(seeds: Sequence[int]) -> list[dict[str, Any]]:
    return [
        dict(protocol=name, learners=LEARNERS, seed=seed, epochs=EPOCHS, lr=LR, compensation=COMPENSATION)
        for seed in seeds
        for name in PROTOCOLS
    ]


def key(run: dict[str, Any]) -> tuple:
    return tuple(run[k] for k in ("protocol", "learners", "seed", "epochs", "lr", "compensation"))


def main(argv: Optional[list[str]] = None) -> None:
    def seeds_option(p: Any) -> None:
        p.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="reported seeds (default: 0,1,2)")

    args, out = parse("protocols", __doc__, argv, seeds_option)
    path = out / "runs.jsonl"
    if not (args.resume or args.report_only) and path.exists():
        path.rename(path.with_suffix(".jsonl.bak"))
    rows = {key(row): row for row in read_rows(path)}
    wanted = runs([int(s) for s in args.seeds.split(",") if s.strip()])
    if not args.report_only:
        commit = source()
        for run in wanted:
            if key(run) in rows:
                continue
            began = time.perf_counter()
            row = {**run, **train(run["protocol"], run["seed"], run["epochs"], run["lr"], run["learners"])}
            rows[key(run)] = row = {**row, "seconds": round(time.perf_counter() - began, 1), **commit}
            print(json.dumps({k: v for k, v in row.items() if not isinstance(v, list)}), flush=True)
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
    have = [rows[key(r)] for r in wanted if key(r) in rows]
    if not have:
        print(f"no runs in {path}: nothing to report")
        return
    from examples.study.protocols_report import write_report

    write_report(have, Path(out))


if __name__ == "__main__":
    main()
