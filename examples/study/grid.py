"""The study's configurations: what one run is (:class:`RunConfig`) and the grids of runs.

Every grid is built to speak to the Rudra paper's three findings: keeping μ·λ constant keeps the baseline's
accuracy while a growing μ·λ hurts; n-softsync has mean staleness about n; without learning-rate modulation
large-n softsync degrades, with it it recovers. ``paper`` is the paper's scale (λ up to 30, simulated learners),
in two stages: a sweep of α0 on the single learner, then every run with the α0 the sweep chose.
"""

from dataclasses import astuple, dataclass, fields
from typing import Any, Iterable


@dataclass(frozen=True)
class RunConfig:
    """One training run. Its fields, all together, are the run's key in ``runs.csv``."""

    protocol: str  # single (λ = 1, no parameter server) | hardsync | softsync | async
    n: int  # softsync's n; async is λ-softsync (n = λ); 0 for hardsync and single
    learners: int  # λ
    batch_size: int  # μ, per learner
    lr_modulation: str  # none | mean | per_gradient
    epochs: int
    num_samples: int
    lr: float
    seed: int
    simulated: int = 0  # 1: the λ learners are simulated in one process (RudraStrategy(simulate=λ))
    spread: float = 0.0  # simulated learners' step times: log-normal with this spread (0: homogeneous)
    momentum: float = 0.9  # SGD's

    @property
    def mu_lambda(self) -> int:
        return self.batch_size * self.learners

    def key(self) -> tuple[Any, ...]:
        return astuple(self)

    @classmethod
    def from_row(cls, row: dict[str, str]) -> "RunConfig":
        """The configuration of a ``runs.csv`` row (values converted back to their field types)."""
        return cls(**{f.name: f.type(row[f.name]) for f in fields(cls) if row.get(f.name, "") != ""})

    def label(self, seed: bool = False) -> str:
        name = {"softsync": f"softsync n={self.n}", "single": "single"}.get(self.protocol, self.protocol)
        return (
            f"{name} λ={self.learners} μ={self.batch_size} lr_mod={self.lr_modulation}"
            + (" simulated" if self.simulated else "")
            + (f" α0={self.lr:g}" if self.protocol == "single" else "")
            + (f" momentum={self.momentum:g}" if self.momentum != 0.9 else "")
            + (f" seed={self.seed}" if seed else "")
        )

    def runner_args(self) -> list[str]:
        return [
            "--protocol",
            self.protocol,
            "--n",
            str(max(1, self.n)),
            "--learners",
            str(self.learners),
            "--batch-size",
            str(self.batch_size),
            "--lr-modulation",
            self.lr_modulation,
            "--epochs",
            str(self.epochs),
            "--num-samples",
            str(self.num_samples),
            "--lr",
            repr(self.lr),
            "--seed",
            str(self.seed),
            "--momentum",
            repr(self.momentum),
        ] + (["--simulate", "--spread", repr(self.spread)] if self.simulated else [])


KEY_FIELDS = [f.name for f in fields(RunConfig)]
RESULT_FIELDS = [
    "mu_lambda",
    "test_error",
    "test_loss",
    "train_loss",
    "wall_s",
    "train_s",
    "samples",
    "samples_per_s",
    "mean_staleness",
    "max_staleness",
    "updates",
    "gradients",
    "dropped",
    "staleness",
]
CSV_FIELDS = KEY_FIELDS + RESULT_FIELDS


# ---- the grids -----------------------------------------------------------------------------------------------
def _grid(
    rows: Iterable[tuple[str, int, int, int, str]],
    epochs: int,
    num_samples: int,
    lr: float,
    seeds: Iterable[int] = (42,),
    simulated: bool = False,
    spread: float = 0.0,
    momentum: float = 0.9,
) -> list[RunConfig]:
    """Configurations from (protocol, n, λ, μ, lr_modulation); duplicates dropped, order kept."""
    out: dict[tuple, RunConfig] = {}
    for seed in seeds:
        for protocol, n, learners, mu, lr_mod in rows:
            if protocol == "async":
                n = learners
            elif protocol in ("hardsync", "single"):
                n = 0
            if protocol in ("hardsync", "single"):
                lr_mod = "none"  # never stale: modulation would change nothing
            sim = simulated and protocol != "single"
            config = RunConfig(
                protocol,
                n,
                learners,
                mu,
                lr_mod,
                epochs,
                num_samples,
                lr,
                seed,
                int(sim),
                spread if sim else 0.0,
                momentum,
            )
            out.setdefault(config.key(), config)
    return list(out.values())


def small_grid() -> list[RunConfig]:
    """10 runs, about five minutes on two busy CPU cores: λ = 4 learners against the single learner with
    μ = 64, at the example configs' α0 = 0.05 (tuned for μλ = 64), 12 epochs of 2880 training samples.

    (1) μλ = 64 kept constant (single μ=64; hardsync and 1-softsync with λ=4, μ=16) against μλ = 512
        (single μ=512, hardsync λ=4 μ=128), at the same number of epochs;
    (2) the staleness of 1-, 2- and 4-softsync (async is 4-softsync for λ = 4), all at λ=4, μ=16;
    (3) 2-softsync and async without LR modulation, with α0/⟨σ⟩ (``mean``) and, for async, with α0/σ per
        gradient (``per_gradient``).
    """
    rows = [
        ("single", 0, 1, 64, "none"),
        ("hardsync", 0, 4, 16, "none"),
        ("softsync", 1, 4, 16, "mean"),
        ("softsync", 2, 4, 16, "mean"),
        ("softsync", 2, 4, 16, "none"),
        ("async", 4, 4, 16, "mean"),
        ("async", 4, 4, 16, "per_gradient"),
        ("async", 4, 4, 16, "none"),
        ("single", 0, 1, 512, "none"),
        ("hardsync", 0, 4, 128, "none"),
    ]
    return _grid(rows, epochs=12, num_samples=4000, lr=0.05)


def medium_grid() -> list[RunConfig]:
    """42 runs (about half an hour here): λ ∈ {2, 4}, μλ ∈ {64, 256}, every n, all three modulations."""
    rows: list[tuple[str, int, int, int, str]] = []
    for mu_lambda in (64, 256):
        rows.append(("single", 0, 1, mu_lambda, "none"))
        for learners in (2, 4):
            mu = mu_lambda // learners
            rows.append(("hardsync", 0, learners, mu, "none"))
            for n in range(1, learners + 1):
                for lr_mod in ("mean", "per_gradient", "none"):
                    rows.append(("softsync" if n < learners else "async", n, learners, mu, lr_mod))
    return _grid(rows, epochs=15, num_samples=4000, lr=0.05)


def large_grid() -> list[RunConfig]:
    """Hundreds of runs for a bigger machine: λ up to 8, μλ from 32 to 512, all three modulations, 2 seeds."""
    rows: list[tuple[str, int, int, int, str]] = []
    for mu_lambda in (32, 64, 128, 512):
        rows.append(("single", 0, 1, mu_lambda, "none"))
        for learners in (2, 4, 8):
            mu = mu_lambda // learners
            if mu < 2:
                continue
            rows.append(("hardsync", 0, learners, mu, "none"))
            for n in sorted({1, 2, learners // 2, learners} - {0}):
                for lr_mod in ("mean", "per_gradient", "none"):
                    rows.append(("softsync" if n < learners else "async", n, learners, mu, lr_mod))
    return _grid(rows, epochs=20, num_samples=8000, lr=0.05, seeds=(42, 43))


def tiny_grid() -> list[RunConfig]:
    """Three very short runs, for the test suite: a single learner, 1-softsync on λ = 2, and 2-softsync on λ = 8
    simulated learners."""
    rows = [("single", 0, 1, 32, "none"), ("softsync", 1, 2, 16, "mean")]
    simulated = [("softsync", 2, 8, 4, "mean")]
    return _grid(rows, epochs=1, num_samples=1000, lr=0.05) + _grid(
        simulated, epochs=1, num_samples=1000, lr=0.05, simulated=True, spread=PAPER_SPREAD
    )


# ---- the paper's scale -----------------------------------------------------------------------------------------
PAPER_MU_LAMBDA = 240  # μλ kept constant: μ = 240, 120, 60, 30, 15, 8 for λ = 1 ... 30
PAPER_LEARNERS = (1, 2, 4, 8, 16, 30)
PAPER_GROWING_MU = 60  # μ kept constant instead: μλ grows with λ (60 ... 1800)
PAPER_NS = (1, 2, 4, 15, 30)  # for λ = 30 (n = 30 is async)
PAPER_EPOCHS = 30
PAPER_SAMPLES = 4000
PAPER_SEEDS = (42, 43, 44)
PAPER_SPREAD = 0.3  # simulated step times vary by about 30 % (log-normal)
PAPER_ALPHA0 = {0.9: (0.05, 0.1, 0.2, 0.3), 0.0: (0.25, 0.5, 0.75, 1.0)}  # per SGD momentum: the paper's 0.9, and none


def paper_sweep(seeds: Iterable[int] = PAPER_SEEDS, momentum: float = 0.9) -> list[RunConfig]:
    """Stage 1: the single learner with μ = μλ at every α0 of the sweep."""
    return [
        config
        for lr in PAPER_ALPHA0[momentum]
        for config in _grid(
            [("single", 0, 1, PAPER_MU_LAMBDA, "none")], PAPER_EPOCHS, PAPER_SAMPLES, lr, seeds, momentum=momentum
        )
    ]


def choose_alpha0(rows: list[dict[str, str]], momentum: float = 0.9) -> float:
    """The α0 of the sweep with the lowest mean test error over its seeds (the paper's way)."""
    errors: dict[float, list[float]] = {}
    for row in rows:
        config = RunConfig.from_row(row)
        if config in paper_sweep(seeds=[config.seed], momentum=momentum):
            errors.setdefault(config.lr, []).append(float(row["test_error"]))
    if not errors:
        raise ValueError("no run of the α0 sweep has finished: cannot choose α0")
    return min(errors, key=lambda lr: (sum(errors[lr]) / len(errors[lr]), lr))


def paper_grid(alpha0: float, seeds: Iterable[int] = PAPER_SEEDS) -> list[RunConfig]:
    """Stage 2, every run at the α0 the sweep chose, simulated learners with jittered step times:

    (1) μλ = 240 constant for λ = 1 ... 30, hardsync and 1-softsync (α0/⟨σ⟩), against μ = 60 constant (hardsync,
        μλ growing to 1800): 3 seeds;
    (2, 3) λ = 30, μ = 8: n = 1, 2, 4, 15, 30 without modulation and with α0/⟨σ⟩ (3 seeds), and with α0/σ per
        gradient (1 seed);
    plus real learner processes beside simulated ones for λ = 4 (1 seed), to check the simulator.
    """
    seeds = list(seeds)
    constant = [("single", 0, 1, PAPER_MU_LAMBDA, "none")]
    growing = [("single", 0, 1, PAPER_GROWING_MU, "none")]
    for learners in PAPER_LEARNERS[1:]:
        constant += [
            ("hardsync", 0, learners, PAPER_MU_LAMBDA // learners, "none"),
            ("softsync", 1, learners, PAPER_MU_LAMBDA // learners, "mean"),
        ]
        growing.append(("hardsync", 0, learners, PAPER_GROWING_MU, "none"))
    lam, mu = PAPER_LEARNERS[-1], PAPER_MU_LAMBDA // PAPER_LEARNERS[-1]
    modulated = [
        ("softsync" if n < lam else "async", n, lam, mu, lr_mod) for n in PAPER_NS for lr_mod in ("none", "mean")
    ]
    per_gradient = [("softsync" if n < lam else "async", n, lam, mu, "per_gradient") for n in PAPER_NS]
    check = [
        ("hardsync", 0, 4, PAPER_MU_LAMBDA // 4, "none"),
        ("softsync", 1, 4, PAPER_MU_LAMBDA // 4, "mean"),
        ("async", 4, 4, PAPER_MU_LAMBDA // 4, "mean"),
    ]
    common = dict(epochs=PAPER_EPOCHS, num_samples=PAPER_SAMPLES, lr=alpha0, spread=PAPER_SPREAD)
    configs = (
        _grid(constant + growing + modulated, seeds=seeds, simulated=True, **common)
        + _grid(per_gradient + check, seeds=seeds[:1], simulated=True, **common)
        + _grid(check, seeds=seeds[:1], **common)
    )
    return list({c.key(): c for c in configs}.values())


def paper_grid_without_momentum(alpha0: float, seeds: Iterable[int] = PAPER_SEEDS) -> list[RunConfig]:
    """Stage 3, plain SGD (momentum 0) at the α0 its own sweep chose, 1 seed: the rows of findings (1) and (3).
    Momentum acts on the stale gradients again and again (it is a delay of its own), so this separates what
    staleness does from what it does to momentum."""
    constant = [("single", 0, 1, PAPER_MU_LAMBDA, "none")]
    for learners in PAPER_LEARNERS[1:]:
        constant += [
            ("hardsync", 0, learners, PAPER_MU_LAMBDA // learners, "none"),
            ("softsync", 1, learners, PAPER_MU_LAMBDA // learners, "mean"),
        ]
    lam, mu = PAPER_LEARNERS[-1], PAPER_MU_LAMBDA // PAPER_LEARNERS[-1]
    modulated = [
        ("softsync" if n < lam else "async", n, lam, mu, lr_mod) for n in PAPER_NS for lr_mod in ("none", "mean")
    ]
    return _grid(
        constant + modulated,
        PAPER_EPOCHS,
        PAPER_SAMPLES,
        alpha0,
        list(seeds)[:1],
        simulated=True,
        spread=PAPER_SPREAD,
        momentum=0.0,
    )


GRIDS = {"tiny": tiny_grid, "small": small_grid, "medium": medium_grid, "large": large_grid, "paper": paper_sweep}
