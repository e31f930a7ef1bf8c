"""Real model sizes (``python -m benchmarks.run --only models``): MLPs of 10 M and 50 M parameters on synthetic
data, 2 and 4 learners, whole epochs: Rudra's defaults and variants against DDP, then one 3x straggler.
"""

from typing import Any

from benchmarks import stats
from benchmarks.config import M, MODEL_SLOWDOWN, MODEL_STRAGGLER_STRATEGIES, MODEL_STRATEGIES, MODEL_TRAINING, TRAINING
from benchmarks.e2e import JOB_TEXT
from benchmarks.report import _f, _size_label


def phase(suite: Any) -> None:
    raw, configs = suite.publish(
        "models",
        (
            f"MLP classifiers (`benchmarks/synthetic.py`: 1000 inputs, 3 hidden layers of one width, 10 classes) on "
            f"synthetic data (standard normal inputs labelled by a random linear teacher), μ = "
            f"{MODEL_TRAINING['batch_size']} per learner, SGD lr {TRAINING['lr']} momentum "
            f"{TRAINING['momentum']}, whole epochs, no step limit. *samples/s*: all learners' batches from the point "
            f"where every learner is past {MODEL_TRAINING['warmup']} batches to the end of the last epoch (when its "
            f"last learner ends it), so every epoch's end and the waiting for the last learner count. *epoch s*: "
            f"median time between consecutive epoch ends, the first left out (under the shared epoch a fast learner "
            f"does not wait for the straggler at an epoch's end, so these vary). Rudra with its default "
            f"options (async: the shared epoch; hardsync: DistributedSampler, as DDP; shared memory on), and async "
            f"with `shared_memory=False` (everything through RPC). *vs DDP*: each run against the mean of the DDP "
            f"(gloo) runs just before and after it, median (lowest–highest) over runs. *Straggler*: the last "
            f"learner sleeps ({MODEL_SLOWDOWN} − 1)·t before every batch, t being the median DDP step time of the "
            f"runs without a straggler above it. *RPC, no shared memory*: `shared_memory=False`, everything through "
            f"RPC over loopback as DDP's all-reduce goes through gloo over loopback (hardsync and async without a "
            f"straggler, async with one): what of a single-host gain is the protocol's. {JOB_TEXT}"
        ),
    )
    for spec in suite.cfg["models"]:
        pool = suite._pool_for(spec["learners"])
        setup = {
            **MODEL_TRAINING,
            "mlp_params": spec["params"],
            "num_learners": spec["learners"],
            "num_samples": spec["samples"],
            "max_epochs": spec["epochs"],
        }
        config = {
            "target_params": spec["params"],
            "learners": spec["learners"],
            "batch_size": MODEL_TRAINING["batch_size"],
            "samples": spec["samples"],
            "epochs": spec["epochs"],
        }
        raw.append({**config, "runs": [], "straggler_runs": []})
        # for the timeouts until DDP has measured a step: 100 ms per million parameters, about 3x DDP's step
        # at 10 M with 2 learners on the README's 2-core machine
        guess_s = 0.1 * spec["params"] / M
        runs = _model_runs(
            suite, pool, setup, spec["reps"], MODEL_STRATEGIES, [0.0] * spec["learners"], guess_s, raw[-1]["runs"]
        )
        config.update(
            parameters=runs[0]["parameters"] if runs else spec["params"],
            runs=stats.summarize_runs(runs),
            straggler={},
        )
        configs.append(config)
        step_ms = config["runs"].get("ddp", {}).get("step_ms")
        if step_ms is None:
            suite.failures.append(
                f"models {_size_label(spec['params'])}, {spec['learners']} learners: "
                f"no DDP step time to calibrate the straggler's sleep"
            )
            continue
        config.update(step_ms=step_ms, slowdown=MODEL_SLOWDOWN, sleep_ms=(MODEL_SLOWDOWN - 1) * step_ms)
        sleep = [0.0] * (spec["learners"] - 1) + [config["sleep_ms"] / 1e3]  # the last rank is the straggler
        runs = _model_runs(
            suite,
            pool,
            setup,
            spec["reps"],
            MODEL_STRAGGLER_STRATEGIES,
            sleep,
            step_ms / 1e3,
            raw[-1]["straggler_runs"],
        )
        config["straggler"] = stats.summarize_runs(runs)
    suite._close_extra_pools()


def _model_runs(
    suite: Any,
    pool: str,
    setup: dict[str, Any],
    reps: int,
    keys: list[str],
    sleep: list[float],
    step_s: float,
    runs: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """The runs of one model size, λ and straggler, appended to ``runs`` as they are measured; ``step_s``: a
    DDP step without the straggler, for the timeout."""
    steps = setup["max_epochs"] * setup["num_samples"] / (setup["batch_size"] * setup["num_learners"])
    timeout = 120 + 3 * steps * (step_s + max(sleep))  # the longest run: DDP, every step waits for the straggler
    label = f"models {_size_label(setup['mlp_params'])}, {setup['num_learners']} learners" + (
        f", straggler +{1e3 * max(sleep):.0f} ms" if max(sleep) else ""
    )
    for seq, (key, rep) in enumerate(suite._schedule(keys, reps)):
        run = suite._train(key, rep, seq, pool=pool, timeout=timeout, sleep_s=sleep, **setup)
        if run is not None:
            runs.append(run)
            suite.log(
                f"{label}, rep {rep} {key}: {_f(run.get('samples_per_s'), '{:.0f}')} samples/s, "
                f"step {_f(run.get('step_ms'), '{:.1f}')} ms, epochs "
                f"{', '.join(f'{x:.2f}' for x in run['epoch_times_s'])} s (job {run['job_wall_s']:.1f} s)"
            )
    return runs
