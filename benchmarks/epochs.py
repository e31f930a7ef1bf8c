"""Epochs with one straggler (``python -m benchmarks.run --only epochs``): whole epochs of MNIST-1D, 2 and 4
learners, the last one 3x or 8x slower: time per epoch and time to accuracy of async (the shared epoch) against
DDP.
"""

from typing import Any

from benchmarks import stats
from benchmarks.config import EPOCH_BATCH, TRAINING
from benchmarks.report import _f


def phase(suite: Any) -> None:
    raw, configs = suite.publish(
        "epochs",
        (
            f"MNIST-1D example module, {suite.cfg['epoch_samples']} samples (72 % of them the train split), "
            f"μ·λ = {EPOCH_BATCH} (μ per learner in the first column), SGD lr {TRAINING['lr']} momentum "
            f"{TRAINING['momentum']}, {suite.cfg['epochs_per_run']} epochs per run, no step limit. The last learner "
            f"spends (k − 1)·t before every batch, t being the median DDP step time without a straggler for that λ "
            f"and μ, measured in this run ({suite.cfg['epoch_calibration_steps']} steps): asleep (*sleep*: its core "
            f"free for the others) or busy-waiting (*busy*: holding its core, as a slow device's compute would). "
            f"*Epoch s*: an epoch ends "
            f"when its last learner ends it (`on_train_epoch_end`, host monotonic clock); median of the times "
            f"between consecutive epoch ends, the first epoch left out as warm-up. Rudra async with its default "
            f"shared epoch, DDP (gloo) with Lightning's DistributedSampler. Runs of async per row: "
            f"{suite.cfg['epoch_reps']}, each between two DDP runs, ratio to their mean, median (lowest–highest) over "
            f"runs. *Ideal*: shared epoch / DDP epoch without overhead, λ / (k·(λ − 1) + 1). *Straggler's share*: of "
            f"the batches the server dealt over the run (`stats.batches`); ideal 1 / (k·(λ − 1) + 1). *Time to "
            f"accuracy*: from the start of training to the rank-0 snapshot (every "
            f"{suite.cfg['snapshot_every']} of its batches) from which every later one and the final weights stay at "
            f"or above {suite.cfg['epoch_target_accuracy']} test accuracy (a fixed threshold below DDP's accuracy "
            f"after these few epochs, with DDP still improving: the accuracy phase has the converged comparison); beside its ratio the epoch-time ideal again (time to accuracy meets it only if async needs "
            f"no more epochs than DDP). *Job*: each async job's wall time (start-up, the epochs, teardown) against "
            f"the mean of the DDP jobs around it."
        ),
        target=suite.cfg["epoch_target_accuracy"],
    )
    for learners in suite.cfg["epoch_learners"]:
        pool = suite._pool_for(learners)
        setup = {
            "num_learners": learners,
            "batch_size": EPOCH_BATCH // learners,
            "num_samples": suite.cfg["epoch_samples"],
        }
        calibration = suite._calibrate(pool, setup)
        if calibration is None:
            continue
        step_s = calibration["step_ms"] / 1e3
        raw.append({"learners": learners, "calibration": calibration, "runs": {}})
        for slowdown, straggle in suite.cfg["epoch_stragglers"]:
            runs = _epoch_runs(suite, pool, setup, step_s, slowdown, straggle)
            raw[-1]["runs"][f"{slowdown:g}x {straggle}"] = runs
            configs.append(
                {
                    "learners": learners,
                    "batch_size": setup["batch_size"],
                    "slowdown": slowdown,
                    "straggle": straggle,
                    "step_ms": 1e3 * step_s,
                    "sleep_ms": 1e3 * (slowdown - 1) * step_s,
                    "ideal": stats.ideal_epoch_ratio(learners, slowdown),
                    "runs": stats.summarize_runs(runs),
                }
            )
    suite._close_extra_pools()


def _epoch_runs(
    suite: Any, pool: str, setup: dict[str, Any], step_s: float, slowdown: float, straggle: str
) -> list[dict[str, Any]]:
    learners = setup["num_learners"]
    epochs = suite.cfg["epochs_per_run"]
    sleep = [0.0] * (learners - 1) + [(slowdown - 1) * step_s]  # the last rank is the straggler
    # the longest run is DDP's, every step as slow as the straggler's (num_samples bounds the train split)
    ddp_s = epochs * setup["num_samples"] / EPOCH_BATCH * slowdown * step_s
    runs = []
    for seq, (key, rep) in enumerate(suite._schedule(["ddp", "async"], suite.cfg["epoch_reps"])):
        run = suite._train(
            key,
            rep,
            seq,
            pool=pool,
            timeout=120 + 3 * ddp_s,
            max_epochs=epochs,
            sleep_s=sleep,
            straggle=straggle,
            snapshot_every=suite.cfg["snapshot_every"],
            target=suite.cfg["epoch_target_accuracy"],
            **setup,
        )
        if run is None:
            continue
        if run.get("batches"):
            run["straggler_share"] = stats.straggler_share(run["batches"], learners - 1)
        runs.append(run)
        suite.log(
            f"epochs {learners} learners, {slowdown:g}x {straggle}, rep {rep} {key}: epoch {_f(run['epoch_s'])} "
            f"s ({', '.join(f'{x:.2f}' for x in run['epoch_times_s'])}), straggler's share "
            f"{_f(run.get('straggler_share'))}, time to {run['tta_target']}: {_f(run['tta_s'])} "
            f"s (best {_f(run['best_accuracy'], '{:.3f}')}; job {run['job_wall_s']:.1f} s)"
        )
    return runs
