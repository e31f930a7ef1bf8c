"""The MNIST-1D phases (``e2e``, ``straggler``): samples/s and time to accuracy of every protocol against DDP,
then one learner 3x slower (its sleep calibrated by the ``e2e`` runs' DDP step time).
"""

import math
from typing import Any

from benchmarks import stats
from benchmarks.config import TRAINING

# the job wall time, of every phase of whole runs (e2e, straggler, models, network)
JOB_TEXT = (
    "*job s*: the job's wall time, from the suite's handing it to the workers to their results, so the Trainer's "
    "set-up, the rendezvous, Rudra's server start and the teardown are in (median over runs); *job / DDP*: each "
    "run's against the mean of the DDP runs just before and after it, median (lowest–highest)."
)


def e2e(suite: Any) -> None:
    runs = []
    steps = suite.cfg["e2e_steps"]
    for seq, (key, rep) in enumerate(suite._schedule(suite.cfg["e2e_strategies"], suite.cfg["e2e_reps"])):
        run = suite._train(
            key,
            rep,
            seq,
            max_steps=[steps, steps],
            sleep_s=[0.0, 0.0],
            snapshot_every=suite.cfg["snapshot_every"],
            target=suite.cfg["target_accuracy"],
        )
        if run is not None:
            runs.append(run)
            suite.log(
                f"e2e rep {rep} {key}: {run['samples_per_s'] or 0:.0f} samples/s, step "
                f"{run.get('step_ms') or 0:.1f} ms, time to {run['tta_target']}: {run['tta_s']} s "
                f"(job {run['job_wall_s']:.1f} s)"
            )
    suite.raw["e2e"] = runs
    suite.summary["e2e"] = stats.summarize_runs(runs)
    suite.summary["e2e_info"] = {
        "target": suite.cfg["target_accuracy"],
        "text": (
            f"MNIST-1D example CNN (`examples/mnist1d.py`, 8 k parameters), 2 learners, μ = "
            f"{TRAINING['batch_size']} per learner, SGD lr {TRAINING['lr']} momentum {TRAINING['momentum']}, "
            f"{steps} steps per learner, {suite.cfg['e2e_reps']} runs of each strategy; DDP runs before every "
            f"{suite.cfg['ddp_every']} other runs and at the end. *samples/s*: all learners' samples over "
            f"the window where both are past {TRAINING['warmup']} batches and neither has stopped (median "
            f"of runs). *vs DDP*: each run against the mean of the DDP runs just before and just after it, "
            f"median (lowest–highest) over runs. *Time to accuracy*: from the start of training to the "
            f"rank-0 snapshot (every {suite.cfg['snapshot_every']} steps) from which every later one and the final "
            f"weights stay at or above {suite.cfg['target_accuracy']} test accuracy (800 test samples; a fixed "
            f"threshold, not DDP's converged accuracy; a run that never stays there counts as never). mean σ: staleness in server "
            f"updates. {JOB_TEXT} *RPC, no shared memory*: async with `shared_memory=False`, gradients and "
            f"weights through RPC over loopback as DDP's go through gloo over loopback: what of a single-host "
            f"gain is the protocol's, not shared memory's."
        ),
    }


def straggler(suite: Any) -> None:
    ddp_step = suite.summary.get("e2e", {}).get("ddp", {}).get("step_ms")
    if ddp_step is None:
        suite.failures.append("straggler: no DDP step time from the end-to-end runs to calibrate the sleep")
        return
    sleep = 2 * ddp_step / 1e3
    window = suite.cfg["straggler_window_s"]
    warmup = TRAINING["warmup"]
    ddp_steps = warmup + 5 + math.ceil(window / (3 * ddp_step / 1e3))
    runs = []
    for seq, (key, rep) in enumerate(suite._schedule(suite.cfg["straggler_strategies"], suite.cfg["straggler_reps"])):
        if key == "ddp":  # lock-step: both ranks must run the same number of steps
            kwargs = {"max_steps": [ddp_steps, ddp_steps]}
        else:  # independent learners: each stops on its own clock
            kwargs = {"max_steps": [100_000, 100_000], "stop_after_s": [window, window]}
        run = suite._train(key, rep, seq, sleep_s=[0.0, sleep], snapshot_every=0, **kwargs)
        if run is not None:
            runs.append(run)
            suite.log(
                f"straggler rep {rep} {key}: {run['samples_per_s'] or 0:.0f} samples/s, steps in "
                f"window {run.get('batches_in_window')}"
            )
    suite.raw["straggler"] = runs
    suite.summary["straggler"] = stats.summarize_runs(runs)
    suite.summary["straggler_info"] = {
        "text": (
            f"Same module and settings; learner 1 sleeps {1e3 * sleep:.1f} ms per batch (2x the median DDP step "
            f"time of section 2, {ddp_step:.1f} ms), so it is 3x slower. DDP runs {ddp_steps} steps per learner; "
            f"Rudra learners run {window:g} s each after warm-up. {suite.cfg['straggler_reps']} runs of each, "
            f"ratios against the DDP runs just before and after, as in section 2. *job s* as there; here DDP runs a "
            f"number of steps and Rudra a time, so *job / DDP* is not a ratio of equal work."
        )
    }
