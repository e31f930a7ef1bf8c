"""Time to accuracy (``python -m benchmarks.run --only accuracy``): samples/s say how fast a strategy goes, not how
soon it has a model as good as the synchronous one. Real learners (the benchmark's workers), the MNIST-1D example
CNN, μ·λ = ``BATCH``, momentum SGD at the rate a sweep on the validation split chose for DDP's budget (``sweep``),
λ = 2 and 4, with one 3x straggler (sleeping, or busy-waiting: holding its core) and without: DDP (gloo) trains
``accuracy_epochs``, each Rudra strategy of ``accuracy_strategies`` (``RudraStrategy(protocol="async")`` with its
default options unless the run names others: ``--accuracy-strategies``) up to ``accuracy_rudra_epochs`` (the target
is time: a strategy whose epochs cost less may spend more of them); DDP's plateau (its mean test accuracy over its
last epoch) minus ``DROP`` is the target, and a run's time to it is when its accuracy reaches it for good
(``stays_from``). All keep rank 0's weights every few batches (``benchmarks.training``), so the target is set after
the runs and the times read from each run's recorded (time, accuracy) snapshots.
"""

import math
import statistics
from typing import Any, Optional

from benchmarks.config import STRATEGY_LABELS, TRAINING
from benchmarks import report, stats
from benchmarks.report import _f
from lightning_rudra.core.compensation import DEFAULT_COMPENSATION

BATCH = 128  # μ·λ, the same for every λ: μ = 64 at λ = 2, 32 at λ = 4
MOMENTUM = 0.9
MAX_EXTENSIONS = 3  # a sweep whose best rate is on the grid's edge adds a rate past it, this many times at most
DROP = 0.01  # the target: DDP's plateau test accuracy minus one point


def final_accuracy(run: dict[str, Any]) -> Optional[float]:
    """The test accuracy of the final weights (of the last snapshot if there are none)."""
    points = stats.series(run)
    return points[-1][1] if points else None


def epoch_accuracy(run: dict[str, Any], epoch: int) -> Optional[float]:
    """The mean test accuracy of rank 0's weights during its epoch ``epoch`` (from 1): its snapshots taken in it
    and, for its last epoch, its final weights. None without snapshots in it."""
    ends = (run.get("epoch_ends_s") or [[]])[0]  # rank 0's, on the clock of the first rank's training start
    if not 1 <= epoch <= len(ends):
        return None
    low = ends[epoch - 2] if epoch > 1 else -math.inf
    high = ends[epoch - 1] if epoch < len(ends) else math.inf
    offset = run.get("rank0_start_s", 0.0)
    values = [a for t, a in stats.series(run) if low < t + offset <= high]
    return statistics.mean(values) if values else None


def epochs_at(run: dict[str, Any], t: Optional[float]) -> Optional[float]:
    """How many epochs the run had done ``t`` s after rank 0's training start: whole epochs (an epoch ends when its
    last learner ends it, a learner left behind in it aside: ``stats.epoch_ends``) and the share of the current one,
    by time; all of them once past the last epoch's end."""
    if t is None or not run.get("epoch_ends_s"):
        return None
    ends = stats.epoch_ends(run["epoch_ends_s"])
    t += run.get("rank0_start_s", 0.0)  # to the epoch ends' clock: from the first rank's training start
    for i, end in enumerate(ends):
        if t <= end:
            previous = ends[i - 1] if i else 0.0
            return i + (t - previous) / (end - previous) if end > previous else float(i)
    return float(len(ends))


def summarize(runs: list[dict[str, Any]], drop: float = DROP) -> dict[str, Any]:
    """Target, times and ratios of one configuration's runs (``ddp`` and Rudra strategies, in the order ``seq`` they
    ran). DDP's plateau is the median over its runs of their mean test accuracy over their last epoch; the target
    is that minus ``drop``; every run's time to it is when it reaches it for good (``stays_from``; None: never),
    and the epochs done by then. Each Rudra run's ratios (time, epochs) are to the mean of the DDP runs just before
    and after it, and one that never reached the target counts as infinitely slow (``stats.summarize_runs``,
    ``stats.never_median``)."""
    for run in runs:
        run["epochs_trained"] = min((len(r) for r in run.get("epoch_ends_s") or []), default=None)
        run["plateau"] = epoch_accuracy(run, run["epochs_trained"] or 0)
    ddp = [r for r in runs if r["strategy"] == "ddp"]
    half = round(stats.median([r["epochs_trained"] for r in ddp]) or 0) // 2  # DDP's half way, for every run
    for run in runs:
        run["half_accuracy"] = epoch_accuracy(run, half)
    plateau = stats.median([r["plateau"] for r in ddp])
    target = None if plateau is None else round(plateau - drop, 6)
    for run in runs:
        points = stats.series(run)
        run["final_acc"] = final_accuracy(run)
        run["tta_target"] = target
        run["best_accuracy"] = max((a for _, a in points), default=None)
        run["tta_s"] = None if target is None else stats.stays_from(points, target)
        run["tta_first_s"] = None if target is None else next((t for t, a in points if a >= target), None)
        run["tta_epochs"] = epochs_at(run, run["tta_s"])
        if run.get("late") is not None and run.get("gradients"):  # the share of pushes whose round had closed
            run["late_share"] = run["late"] / (run["late"] + run["gradients"])
    out = stats.summarize_runs(runs)
    for strategy, entry in out.items():
        mine = [r for r in runs if r["strategy"] == strategy]
        entry.update(
            final_accuracy=stats.median([r["final_acc"] for r in mine]),
            final_accuracy_runs=[r["final_acc"] for r in mine],
            tta_epochs=stats.median([r["tta_epochs"] for r in mine]),
            tta_epochs_runs=[r["tta_epochs"] for r in mine],
            tta_first_s_runs=[r["tta_first_s"] for r in mine],
            epochs_trained=stats.median([r["epochs_trained"] for r in mine]),
            half_accuracy=stats.median([r["half_accuracy"] for r in mine]),  # beside DDP's: accuracy per epoch
        )
    return {
        "ddp_plateau": plateau,
        "ddp_plateau_runs": [r["plateau"] for r in ddp],
        "ddp_half_accuracy": stats.median([r["half_accuracy"] for r in ddp]),
        "target": target,
        "runs": out,
    }


def rate_scores(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rate of a sweep (``results``: every (lr, order) trained), the mean validation accuracy over its data
    orders, by rate."""
    rates = sorted({r["lr"] for r in results})
    return [
        {
            "lr": lr,
            "val_accuracy": statistics.mean(r["val_accuracy"] for r in results if r["lr"] == lr),
            "val_accuracy_runs": [r["val_accuracy"] for r in results if r["lr"] == lr],
        }
        for lr in rates
    ]


def best_rate(scores: list[dict[str, Any]]) -> float:
    """The rate of the best mean validation accuracy (the lowest such rate on a tie)."""
    return max(scores, key=lambda s: s["val_accuracy"])["lr"]


def past_edge(scores: list[dict[str, Any]]) -> Optional[float]:
    """The rate to add when the best one is on the grid's edge: twice the highest, or half the lowest; None when
    the best has a rate on either side of it."""
    best, rates = best_rate(scores), [s["lr"] for s in scores]
    if best == max(rates):
        return 2 * best
    if best == min(rates):
        return best / 2
    return None


def sweep(suite: Any, learners: int) -> Optional[dict[str, Any]]:
    """DDP's rate for this phase's budget: plain SGD with batch ``BATCH`` (DDP's arithmetic) from the phase's
    initial weights, ``accuracy_epochs`` epochs, every rate of ``accuracy_rates`` in ``accuracy_sweep_orders``
    data orders, split between the pool's ``learners`` workers; scored on the validation split. A best rate on the
    grid's edge adds the rate past it (``past_edge``) and trains that, up to ``MAX_EXTENSIONS`` times."""
    cfg = suite.cfg
    epochs, orders, samples = cfg["accuracy_epochs"], cfg["accuracy_sweep_orders"], cfg["accuracy_samples"]
    rates: list[float] = list(cfg["accuracy_rates"])
    results: list[dict[str, Any]] = []
    for _ in range(1 + MAX_EXTENSIONS):
        tasks = [(lr, order) for lr in rates for order in range(orders)]
        steps = len(tasks) / learners * epochs * samples / BATCH
        out = suite.job(
            "main",
            "benchmarks.training:sweep",
            120 + 0.1 * steps,  # 0.1 s a step: about 10 times what one takes on this machine
            tasks=[tasks[rank::learners] for rank in range(learners)],
            epochs=epochs,
            batch_size=BATCH,
            momentum=MOMENTUM,
            seed=TRAINING["seed"],  # the runs' initial weights
            num_samples=samples,
        )
        if out is None:
            return None
        results += [r for rank in out for r in rank]
        scores = rate_scores(results)
        extra = past_edge(scores)
        if extra is None:
            break
        rates = [extra]
    best = best_rate(scores)
    measured = ", ".join(f"{s['lr']:g}: {s['val_accuracy']:.3f}" for s in scores)
    suite.log(f"accuracy: DDP's rate, validation accuracy after {epochs} epochs: {measured}; chosen {best:g}")
    return {
        "lr": best,
        "edge": past_edge(scores) is not None,
        "epochs": epochs,
        "orders": orders,
        "scores": scores,
    }


def describe(cfg: dict[str, Any], chosen: dict[str, Any]) -> str:
    """The phase's text in the report: the model, DDP's rate (``chosen``: ``sweep``'s), what each column means."""
    epochs, reps = cfg["accuracy_epochs"], cfg["accuracy_reps"]
    rudra_epochs = cfg.get("accuracy_rudra_epochs", epochs)
    rudra = ", ".join(STRATEGY_LABELS.get(k, k) for k in cfg["accuracy_strategies"])
    name = report.rudra_name(cfg["accuracy_strategies"])  # as the table's columns name them
    grid = ", ".join(f"{s['lr']:g}" for s in chosen["scores"])
    return (
        f"MNIST-1D example CNN, {cfg['accuracy_samples']} samples (72 % of them the train split, 8 % the "
        f"validation split the rate is chosen on, 20 % the test split the accuracy is of), μ·λ = {BATCH} (μ per "
        f"learner in the first column), SGD momentum {MOMENTUM}, lr {chosen['lr']:g} for DDP and every Rudra "
        f"strategy: the best of a sweep for DDP's budget (DDP with μ·λ = {BATCH} does the arithmetic of plain SGD "
        f"with batch {BATCH}, so the sweep trains that in one process per rate, from the same initial weights, "
        f"{epochs} epochs in {chosen['orders']} data order(s)), by mean validation accuracy of the final weights; "
        f"rates {grid}"
        + (" (the best still on the grid's edge after extending it)" if chosen["edge"] else "")
        + f", in the table below. DDP (gloo) and {rudra} (RudraStrategy's default options but those named: the "
        f'shared epoch, `compensation="{DEFAULT_COMPENSATION}"` where gradients are stale) train from the same '
        f"initial weights, DDP {epochs} epochs, "
        + (
            f"the Rudra strategies up to {rudra_epochs} (the target is time: a strategy whose epochs cost less may "
            "spend more of them)" + (", hivemind DDP's." if "hivemind" in cfg["accuracy_strategies"] else ".")
            if rudra_epochs != epochs
            else "the others as many."
        )
        + f" *DDP plateau*: the mean test accuracy of rank 0's weights over DDP's last epoch "
        f"(its snapshots then and its final weights), median over DDP runs; beside it the same over epoch "
        f"{epochs // 2}, to show whether it still improved. *Target*: the plateau minus {100 * DROP:g} point. "
        f"*Time to target*: from rank 0's training start (process start, rendezvous and the server's start left "
        f"out; they are in *job*) to the first snapshot (every {cfg['snapshot_every']} of rank 0's batches) from "
        f"which every later snapshot and the final weights are at or above the target (never if the final weights "
        f"are below it), read after the runs; in brackets the epochs done by then (an epoch ends when its last "
        f"learner ends it, but for one still in it after another ended the next: a straggler left behind in a "
        f"drained epoch, retraining its own late batch). *Straggler*: the last learner spends (k − 1)·t before every batch, t being the median "
        f"DDP step time without a straggler for that λ and μ, measured in this run "
        f"({cfg['epoch_calibration_steps']} steps), either asleep (its core free for the others) or busy-waiting "
        f"(holding its core, as a slow device's compute would); k = 1: none. Runs per row: {reps} of the Rudra "
        f"strategy, each between two DDP runs (the strategies take turns); *{name} / DDP*: each run's time against "
        f"the mean of those two DDP runs' times, median (lowest–highest) over runs, "
        f'"never" if it did not reach the target in half its runs or more. *Ideal (epoch time)*: async\'s ratio of '
        f"epoch times without overhead, λ / (k·(λ − 1) + 1) (section 5); time to target would meet it only if "
        f"async needed no more epochs than DDP. *Job*: each Rudra job's wall time (start-up, its {rudra_epochs} "
        f"epochs, teardown) against the mean of the DDP jobs around it. *Epochs / DDP's* (the second table): the "
        f"epochs a run had done when it reached the target against the DDP runs' around it: a round of gradients "
        f"all of the current weights (hardsync, K-batch-sync, backup learners) does DDP's arithmetic, so it should "
        f"need no more; beside it the mean test accuracy over epoch {epochs // 2}, and the gradients that came "
        f"after their round closed (*late*: not applied, their batches dealt again), per run and as a share of the "
        f"pushes. Times are wall clock on a small machine shared with other jobs (see the load average above): "
        f"they are noisy, the ratios of runs side by side less so."
        + (
            " *hivemind* is not a Rudra strategy: `hivemind.Optimizer`'s peers in a torch loop (`benchmarks/peers.py`, "
            "whose docstring gives its settings), in the Rudra columns; its run's global steps are in its results."
            if "hivemind" in cfg["accuracy_strategies"]
            else ""
        )
    )


def phase(suite: Any) -> None:
    """The benchmark phase (``suite``: ``benchmarks.suite.Suite``): DDP's rate (``sweep``); per λ, one DDP
    calibration run (its median step time t scales the straggler's delay, (k − 1)·t per batch on the last rank,
    slept or busy-waited, as the epochs phase does), then per straggler DDP and each strategy of
    ``accuracy_strategies`` alternated as ``Suite._schedule`` orders them."""
    cfg = suite.cfg
    epochs, reps, strategies = cfg["accuracy_epochs"], cfg["accuracy_reps"], cfg["accuracy_strategies"]
    rudra_epochs = cfg.get("accuracy_rudra_epochs", epochs)
    chosen = sweep(suite, suite.pools["main"].size)
    if chosen is None:
        suite.failures.append("accuracy: no rate sweep, so no rate for DDP")
        return
    optimizer = {"lr": chosen["lr"], "momentum": MOMENTUM}
    raw, configs = suite.publish("accuracy", describe(cfg, chosen), sweep=chosen)
    for learners in cfg["accuracy_learners"]:
        pool = suite._pool_for(learners)
        setup = {"num_learners": learners, "batch_size": BATCH // learners, "num_samples": cfg["accuracy_samples"]}
        calibration = suite._calibrate(pool, {**setup, **optimizer}, phase="accuracy")
        if calibration is None:
            continue
        step_s = calibration["step_ms"] / 1e3
        raw.append({"learners": learners, "calibration": calibration, "runs": {}})
        for slowdown, straggle in cfg["accuracy_stragglers"]:
            if straggle == "busy" and learners not in cfg["accuracy_busy_learners"]:
                continue
            straggle = straggle if slowdown > 1 else None
            label = f"{slowdown:g}x" + (f" {straggle}" if straggle else "")
            # the longest run: DDP's, every step as slow as the straggler's, or a Rudra run's more epochs
            timeout = 120 + 3 * max(epochs, rudra_epochs) * cfg["accuracy_samples"] / BATCH * max(slowdown, 2) * step_s
            runs: list[dict[str, Any]] = []
            raw[-1]["runs"][label] = runs
            for seq, (key, rep) in enumerate(suite._schedule(["ddp", *strategies], reps)):
                run = suite._train(
                    key,
                    rep,
                    seq,
                    pool=pool,
                    timeout=timeout,
                    sleep_s=[0.0] * (learners - 1) + [(slowdown - 1) * step_s],  # the last rank is the straggler
                    straggle=straggle or "sleep",
                    snapshots=True,
                    max_epochs=epochs if key in ("ddp", "hivemind") else rudra_epochs,  # hivemind: not Rudra's
                    snapshot_every=cfg["snapshot_every"],
                    **setup,
                    **optimizer,
                )
                if run is None:
                    continue
                runs.append(run)
                late = f", late {run['late']} of {run['late'] + run['gradients']}" if run.get("late") else ""
                suite.log(
                    f"accuracy {learners} learners, {label}, rep {rep} {key}: final accuracy "
                    f"{_f(final_accuracy(run), '{:.3f}')}, best "
                    f"{_f(max((a for _, a in stats.series(run)), default=None), '{:.3f}')}, epoch "
                    f"{_f(run.get('epoch_s'))} s (job {run['job_wall_s']:.1f} s){late}"
                )
            summary = summarize(runs)
            configs.append(
                {
                    "learners": learners,
                    "batch_size": BATCH // learners,
                    "slowdown": slowdown,
                    "straggle": straggle,
                    "step_ms": 1e3 * step_s,
                    "sleep_ms": 1e3 * (slowdown - 1) * step_s,
                    "epochs": epochs,
                    "rudra_epochs": rudra_epochs,
                    "lr": chosen["lr"],
                    "ideal": stats.ideal_epoch_ratio(learners, slowdown),  # async's (the shared epoch's)
                    **summary,
                }
            )
            ddp = summary["runs"].get("ddp", {})
            for key in strategies:
                rudra = summary["runs"].get(key, {})
                suite.log(
                    f"accuracy {learners} learners, {label}: target {_f(summary['target'], '{:.3f}')}, time to it "
                    f"DDP {_f(ddp.get('tta_s'))} s, {key} {_f(rudra.get('tta_s'))} s, {key} / DDP "
                    f"{_f(rudra.get('tta_vs_ddp'))}, epochs {_f(rudra.get('tta_epochs_vs_ddp'))}, job "
                    f"{_f(rudra.get('job_vs_ddp'))}"
                )
    suite._close_extra_pools()
