"""Time to accuracy (``python -m benchmarks.run --only accuracy``): samples/s say how fast a strategy goes, not how
soon it has a model as good as the synchronous one. Real learners (the benchmark's workers), the MNIST-1D example
CNN, μ·λ = ``BATCH``, momentum SGD at the rate that is best for that batch (``OPTIMIZER``), λ = 2 and 4, with one
3x straggler and without: DDP (gloo) trains E epochs, and its final test accuracy minus ``DROP`` is the target;
``RudraStrategy(protocol="async")`` with its default options trains up to 2E epochs. Both keep rank 0's weights
every few batches (``benchmarks.training``), so the target is set after the runs and the time to it read from each
run's recorded (time, accuracy) snapshots: one async run serves whatever the target.
"""

import math
import statistics
from typing import Any, Optional

from benchmarks import stats
from benchmarks.report import _f

BATCH = 128  # μ·λ, the same for every λ: μ = 64 at λ = 2, 32 at λ = 4
OPTIMIZER = {"lr": 0.1, "momentum": 0.9}  # the rate that is best for batch 128 in the project's simulations
DROP = 0.01  # the target: DDP's final test accuracy minus one point
STALE_EPOCHS = 2  # async may train this many times DDP's epochs (its epochs are the cheaper ones)


def series(run: dict[str, Any]) -> list[tuple[float, float]]:
    """A run's (seconds since rank 0's training start, test accuracy) snapshots, its final weights last."""
    return list(run.get("accuracy") or []) + ([tuple(run["final_accuracy"])] if run.get("final_accuracy") else [])


def final_accuracy(run: dict[str, Any]) -> Optional[float]:
    """The test accuracy of the final weights (of the last snapshot if there are none)."""
    points = series(run)
    return points[-1][1] if points else None


def epochs_at(run: dict[str, Any], t: Optional[float]) -> Optional[float]:
    """How many epochs the run had done ``t`` s after rank 0's training start: whole epochs (an epoch ends when its
    last learner ends it) and the share of the current one, by time; all of them once past the last epoch's end."""
    if t is None or not run.get("epoch_ends_s"):
        return None
    ranks = run["epoch_ends_s"]
    ends = [max(r[e] for r in ranks) for e in range(min(len(r) for r in ranks))]
    t += run.get("rank0_start_s", 0.0)  # to the epoch ends' clock: from the first rank's training start
    for i, end in enumerate(ends):
        if t <= end:
            previous = ends[i - 1] if i else 0.0
            return i + (t - previous) / (end - previous) if end > previous else float(i)
    return float(len(ends))


def summarize(runs: list[dict[str, Any]], drop: float = DROP) -> dict[str, Any]:
    """Target, times and ratios of one configuration's runs (``ddp`` and ``async``, in the order ``seq`` they ran).
    The target is the median of the DDP runs' final accuracies minus ``drop``; every run's time to it is the first
    snapshot at or above it (None: never). Each async run's ratio is to the mean of the DDP runs just before and
    after it (``stats.summarize_runs``); one that never reached the target counts as infinitely slow, so the
    median ratio is None (never) when half the async runs or more never reached it."""
    ddp_final = stats.median([final_accuracy(r) for r in runs if r["strategy"] == "ddp"])
    target = None if ddp_final is None else round(ddp_final - drop, 6)
    for run in runs:
        run["final_acc"] = final_accuracy(run)
        run["tta_target"] = target
        run["tta_s"], run["best_accuracy"] = (
            (None, None) if target is None else stats.time_to_accuracy({"accuracy": series(run)}, target)
        )
        run["tta_epochs"] = epochs_at(run, run["tta_s"])
        run["epochs_trained"] = min((len(r) for r in run.get("epoch_ends_s") or []), default=None)
    out = stats.summarize_runs(runs)
    for strategy, entry in out.items():
        mine = [r for r in runs if r["strategy"] == strategy]
        entry.update(
            final_accuracy=stats.median([r["final_acc"] for r in mine]),
            final_accuracy_runs=[r["final_acc"] for r in mine],
            tta_epochs=stats.median([r["tta_epochs"] for r in mine]),
            tta_epochs_runs=[r["tta_epochs"] for r in mine],
            epochs_trained=stats.median([r["epochs_trained"] for r in mine]),
            job_wall_s=stats.median([r.get("job_wall_s") for r in mine]),
        )
        if strategy != "ddp" and target is not None:
            reps = [math.inf if t is None else r for r, t in zip(entry["tta_vs_ddp_reps"], entry["tta_s_reps"])]
            known = [r for r in reps if r is not None]
            ratio = statistics.median(known) if known else None
            entry["tta_vs_ddp"] = None if ratio is None or math.isinf(ratio) else ratio
            entry["tta_vs_ddp_reps"] = [None if r is not None and math.isinf(r) else r for r in reps]
    return {"ddp_final_accuracy": ddp_final, "target": target, "runs": out}


def phase(suite: Any) -> None:
    """The benchmark phase (``suite``: ``benchmarks.suite.Suite``): per λ, one DDP calibration run (its median step
    time t scales the straggler's sleep, (k − 1)·t per batch on the last rank, as the epochs phase does), then per
    slowdown k DDP and async alternated as ``Suite._schedule`` orders them."""
    cfg = suite.cfg
    epochs, reps = cfg["accuracy_epochs"], cfg["accuracy_reps"]
    raw, configs = suite.publish(
        "accuracy",
        (
            f"MNIST-1D example CNN, {cfg['accuracy_samples']} samples (72 % of them the train split, 20 % the test "
            f"split the accuracy is of), μ·λ = {BATCH} (μ per learner in the first column), SGD lr {OPTIMIZER['lr']} "
            f"momentum {OPTIMIZER['momentum']} (the rate that is best for batch {BATCH} in the project's simulations). "
            f"DDP (gloo) trains {epochs} epochs; the median of its runs' final test accuracies (of the final weights) "
            f"minus {100 * DROP:g} point is the *target*. Rudra async with its default options (shared epoch, "
            f'`compensation="momentum"`) trains {STALE_EPOCHS * epochs} epochs, from the same initial weights. '
            f"*Time to target*: from rank 0's training start (process start, rendezvous and the server's start left "
            f"out, as in section 5) to its first weights (snapshots every "
            f"{cfg['snapshot_every']} of its batches, then the final weights) at or above the target, read after the "
            f"runs; in brackets the epochs done by then (an epoch ends when its last learner ends it). *Straggler*: the "
            f"last learner sleeps (k − 1)·t before every batch, t being the median DDP step time without a straggler "
            f"for that λ and μ, measured in this run ({cfg['epoch_calibration_steps']} steps); k = 1: none. Runs per "
            f"row: {reps} of async, each between two DDP runs; *async / DDP*: each async run's time against the mean "
            f'of those two DDP runs\' times, median (lowest–highest) over runs, "never" if async did not reach the '
            f"target in half its runs or more. Times are wall clock on a small machine shared with other jobs (see "
            f"the load average above): they are noisy, the ratios of runs side by side less so."
        ),
    )
    for learners in cfg["accuracy_learners"]:
        pool = suite._pool_for(learners)
        setup = {
            "num_learners": learners,
            "batch_size": BATCH // learners,
            "num_samples": cfg["accuracy_samples"],
            **OPTIMIZER,
        }
        calibration = suite._calibrate(pool, setup, phase="accuracy")
        if calibration is None:
            continue
        step_s = calibration["step_ms"] / 1e3
        raw.append({"learners": learners, "calibration": calibration, "runs": {}})
        for slowdown in cfg["accuracy_slowdowns"]:
            sleep = [0.0] * (learners - 1) + [(slowdown - 1) * step_s]  # the last rank is the straggler
            # the longest run: async's 2E epochs, or DDP's E with every step as slow as the straggler's
            timeout = 120 + 3 * STALE_EPOCHS * epochs * cfg["accuracy_samples"] / BATCH * max(slowdown, 2) * step_s
            runs: list[dict[str, Any]] = []
            raw[-1]["runs"][f"{slowdown:g}x"] = runs
            for seq, (key, rep) in enumerate(suite._schedule(["ddp", "async"], reps)):
                run = suite._train(
                    key,
                    rep,
                    seq,
                    pool=pool,
                    timeout=timeout,
                    sleep_s=sleep,
                    snapshots=True,
                    max_epochs=epochs * (1 if key == "ddp" else STALE_EPOCHS),
                    snapshot_every=cfg["snapshot_every"],
                    **setup,
                )
                if run is None:
                    continue
                runs.append(run)
                suite.log(
                    f"accuracy {learners} learners, {slowdown:g}x, rep {rep} {key}: final accuracy "
                    f"{_f(final_accuracy(run), '{:.3f}')}, best "
                    f"{_f(max((a for _, a in series(run)), default=None), '{:.3f}')}, epoch "
                    f"{_f(run.get('epoch_s'))} s (job {run['job_wall_s']:.1f} s)"
                )
            summary = summarize(runs)
            configs.append(
                {
                    "learners": learners,
                    "batch_size": BATCH // learners,
                    "slowdown": slowdown,
                    "step_ms": 1e3 * step_s,
                    "sleep_ms": 1e3 * (slowdown - 1) * step_s,
                    "epochs": epochs,
                    "stale_epochs": STALE_EPOCHS * epochs,
                    **summary,
                }
            )
            rudra, ddp = summary["runs"].get("async", {}), summary["runs"].get("ddp", {})
            suite.log(
                f"accuracy {learners} learners, {slowdown:g}x: target {_f(summary['target'], '{:.3f}')}"
                f", time to it DDP {_f(ddp.get('tta_s'))} s, async {_f(rudra.get('tta_s'))} s, "
                f"async / DDP {_f(rudra.get('tta_vs_ddp'))}"
            )
    suite._close_extra_pools()
