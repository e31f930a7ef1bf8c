"""From raw measurements to medians and ratios: samples/s, epoch times, bytes on the link, time to accuracy,
and the per-strategy summaries of runs and of the transport jobs.

Every ratio is taken within one round (numbers measured side by side in the same minute), and the median is
taken over rounds: on a shared machine that is far steadier than a ratio of two medians.
"""

import math
import statistics
from typing import Any, Optional


def median(values: list[Optional[float]]) -> Optional[float]:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(values) if values else None


def ratios(a: list[Optional[float]], b: list[Optional[float]]) -> list[Optional[float]]:
    return [x / y if x is not None and y else None for x, y in zip(a, b)]


# ---- training runs ------------------------------------------------------------------------------------------
def throughput(ranks: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Samples/s over the window where every learner is past ``warmup`` batches and none has stopped."""
    times = [r["times"] for r in ranks]
    if any(len(t) <= warmup + 1 for t in times):
        return {"samples_per_s": None}
    start = max(t[warmup - 1] for t in times)
    end = min(t[-1] for t in times)
    counts = [sum(1 for x in t if start < x <= end) for t in times]
    batch = ranks[0]["batch_size"]
    steps0 = [b - a for a, b in zip(times[0][warmup:], times[0][warmup + 1 :])]
    return {
        "samples_per_s": batch * sum(counts) / (end - start) if end > start else None,
        "window_s": end - start,
        "batches_in_window": counts,
        "step_ms_rank": [1e3 * statistics.median([b - a for a, b in zip(t[warmup:], t[warmup + 1 :])]) for t in times],
        "step_ms": 1e3 * statistics.median(steps0),
    }


def series(run: dict[str, Any]) -> list[tuple[float, float]]:
    """A run's (seconds since rank 0's training start, test accuracy) snapshots, its final weights last."""
    return list(run.get("accuracy") or []) + ([tuple(run["final_accuracy"])] if run.get("final_accuracy") else [])


def stays_from(points: list[tuple[float, float]], target: float) -> Optional[float]:
    """The time of the first point from which every later point, the last (the final weights) included, is at or
    above ``target``: one lucky snapshot on a noisy curve does not count. None if the last point is below it."""
    since = None
    for t, accuracy in points:
        if not accuracy >= target:  # NaN too
            since = None
        elif since is None:
            since = t
    return since


def time_to_accuracy(rank0: dict[str, Any], target: float) -> tuple[Optional[float], Optional[float]]:
    """(seconds from the start of training to when rank 0's accuracy reaches ``target`` for good (``stays_from``:
    its snapshots, then its final weights), best accuracy)."""
    points = series(rank0)
    return stays_from(points, target), max((a for _, a in points), default=None)


def epoch_ends(ranks: list[list[float]]) -> list[float]:
    """When each epoch ended (``ranks``: each rank's epoch ends, one clock): when its last learner ended it, but
    for a learner still in it after another had ended the next one. The shared epoch keeps only the two newest
    epochs, so such a learner is one the others left behind in a drained epoch: under K-batch-sync and backup
    learners a straggler whose gradients are all late takes its own late batch back, again and again, and ends all
    its epochs at the run's end. The last epoch ends when its last learner ends it (the job's end)."""
    epochs = min((len(r) for r in ranks), default=0)
    out = []
    for e in range(epochs):
        nxt = min(r[e + 1] for r in ranks) if e + 1 < epochs else math.inf
        out.append(max((r[e] for r in ranks if r[e] <= nxt), default=max(r[e] for r in ranks)))
    return out


def epoch_times(ranks: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Seconds per epoch: an epoch ends when its last learner ends it, and the first one is warm-up (process
    start, rendezvous, first allocations), so the times are between consecutive epoch ends. Under the shared
    epoch a fast learner does not wait at an epoch's end for a straggler, so these vary: ``epoch_ends_s`` (per
    rank, from the earliest train start) and ``epoch_batches`` (per rank and epoch) show how the learners'
    epochs overlap.

    And samples/s to the end: all learners' batches from the point where every learner is past ``warmup``
    batches to the end of the last epoch (its last learner's), so that every epoch's end and the waiting for the
    last learner count (``throughput``'s window ends when the first learner stops and leaves them out)."""
    ends = epoch_ends([r["epoch_ends"] for r in ranks])
    times = [b - a for a, b in zip(ends, ends[1:])]
    start = min(r["start"] for r in ranks)
    out: dict[str, Any] = {
        "epoch_s": median(times),
        "epoch_times_s": times,
        "epoch_ends_s": [[e - start for e in r["epoch_ends"]] for r in ranks],
        "epoch_batches": [
            [sum(a < t <= b for t in r["times"]) for a, b in zip([-math.inf] + r["epoch_ends"], r["epoch_ends"])]
            for r in ranks
        ],
    }
    if ends and all(len(r["times"]) >= warmup for r in ranks):
        first = max(r["times"][warmup - 1] for r in ranks)
        samples = sum(r["batch_size"] * sum(first < t <= ends[-1] for t in r["times"]) for r in ranks)
        out["samples_per_s"] = samples / (ends[-1] - first) if ends[-1] > first else None
    return out


def link_per_step(ranks: list[dict[str, Any]], per_host: int, warmup: int) -> Optional[list[dict[str, float]]]:
    """Bytes each host's end of the link sent and received per step (λ batches: one per learner), from the
    counters its first learner read at its batch ends (``link``), over its batches once every learner is past
    ``warmup`` (the rendezvous and the first weights left out); the steps are every learner's batches in that
    time over λ. None without counters."""
    if any(len(r["times"]) < warmup for r in ranks) or not all(r.get("link") for r in ranks[::per_host]):
        return None
    start = max(r["times"][warmup - 1] for r in ranks)
    hosts = []
    for first in ranks[::per_host]:
        read = [(t, counters) for t, counters in zip(first["times"], first["link"]) if t >= start]
        if len(read) < 2:
            return None
        (t0, (sent0, received0)), (t1, (sent1, received1)) = read[0], read[-1]
        steps = sum(t0 < t <= t1 for r in ranks for t in r["times"]) / len(ranks)
        hosts.append({"sent": (sent1 - sent0) / steps, "received": (received1 - received0) / steps})
    return hosts


def straggler_share(batches: dict[str, int], straggler: int) -> Optional[float]:
    """The straggler's share of all batches taken (``batches``: the server's learner -> count, JSON keys)."""
    total = sum(batches.values())
    return batches.get(str(straggler), 0) / total if total else None


def ideal_epoch_ratio(learners: int, slowdown: float) -> float:
    """Shared epoch / DDP epoch for λ learners, one ``slowdown`` (k) times slower, with no overhead: DDP's epoch
    is (N/λ)·k·t (every step waits for the straggler), a shared epoch N / ((λ−1)/t + 1/(k·t)) (every learner
    takes batches at its own rate). The straggler's ideal share of the batches is this ratio / λ."""
    return learners / (slowdown * (learners - 1) + 1)


def never_median(values: list[Optional[float]], times: list[Optional[float]]) -> Optional[float]:
    """The median of ``values`` (times to a target, or their ratios) where a run whose time is None never reached
    the target and counts as infinitely slow: None ("never") when half the runs or more never reached it, so that
    a run that never gets there cannot make the median look better by being left out. A value that is None for
    another reason (no DDP run beside it reached the target) is left out."""
    known = [math.inf if t is None else v for v, t in zip(values, times)]
    known = [v for v in known if v is not None and not (isinstance(v, float) and math.isnan(v))]
    middle = statistics.median(known) if known else None
    return None if middle is None or math.isinf(middle) else middle


def summarize_runs(runs: list[dict[str, Any]], baseline: str = "ddp") -> dict[str, Any]:
    """``runs``: {strategy, seq (order of the run), samples_per_s, tta_s, epoch_s, ...}. Per strategy: medians
    over its runs, and the median of its per-run ratios to the mean of the baseline runs just before and after
    it."""
    base_runs = sorted((r for r in runs if r["strategy"] == baseline), key=lambda r: r["seq"])

    def bracket(run: dict[str, Any], field: str) -> Optional[float]:
        before = [b for b in base_runs if b["seq"] < run["seq"]][-1:]
        after = [b for b in base_runs if b["seq"] > run["seq"]][:1]
        values = [b[field] for b in before + after if b.get(field) is not None]
        return sum(values) / len(values) if values else None

    out: dict[str, Any] = {}
    for strategy in dict.fromkeys(r["strategy"] for r in runs):
        mine = sorted((r for r in runs if r["strategy"] == strategy), key=lambda r: r["seq"])
        sps = [r.get("samples_per_s") for r in mine]
        if strategy == baseline:
            vs, tta_vs = [1.0] * len(mine), [1.0] * len(mine)
        else:
            vs = ratios(sps, [bracket(r, "samples_per_s") for r in mine])
            tta_vs = ratios([r.get("tta_s") for r in mine], [bracket(r, "tta_s") for r in mine])
        entry = {
            "runs": len(mine),
            "samples_per_s": median(sps),
            "samples_per_s_runs": sps,
            "vs_ddp": median(vs),
            "vs_ddp_reps": vs,
            "step_ms": median([r.get("step_ms") for r in mine]),
        }
        if any(r.get("tta_target") is not None for r in mine):
            tta = [r.get("tta_s") for r in mine]
            entry.update(
                {
                    "tta_s": never_median(tta, tta),
                    "tta_s_reps": tta,
                    "tta_vs_ddp": never_median(tta_vs, tta),
                    "tta_vs_ddp_reps": tta_vs,
                    "tta_reached": sum(t is not None for t in tta),
                    "best_accuracy": median([r.get("best_accuracy") for r in mine]),
                }
            )

        def against(field: str) -> tuple[list[Optional[float]], list[Optional[float]]]:
            """Each run's ``field`` and its ratio to the baseline runs around it (1 for the baseline's own)."""
            values = [r.get(field) for r in mine]
            if strategy == baseline:
                return values, [1.0] * len(mine)
            return values, ratios(values, [bracket(r, field) for r in mine])

        epoch, epoch_vs = against("epoch_s")
        if any(e is not None for e in epoch):
            entry.update(
                {
                    "epoch_s": median(epoch),
                    "epoch_s_reps": epoch,
                    "epoch_vs_ddp": median(epoch_vs),
                    "epoch_vs_ddp_reps": epoch_vs,
                }
            )
        jobs, job_vs = against("job_wall_s")
        if any(j is not None for j in jobs):  # start-up and teardown included: what a user waits for
            entry.update(
                {
                    "job_wall_s": median(jobs),
                    "job_wall_s_runs": jobs,
                    "job_vs_ddp": median(job_vs),
                    "job_vs_ddp_reps": job_vs,
                }
            )
        if any("tta_epochs" in r for r in mine):  # the accuracy phase's: epochs done when the target was reached
            epochs_to, epochs_vs = against("tta_epochs")
            entry.update(tta_epochs_vs_ddp=never_median(epochs_vs, epochs_to), tta_epochs_vs_ddp_reps=epochs_vs)
        # the server's counts (late, redealt: rounds that do not wait for the slowest learner), where there are any
        for field in ("straggler_share", "mean_staleness", "late", "late_share", "redealt"):
            values = [r.get(field) for r in mine]
            if any(v is not None for v in values):
                entry[field] = median(values)
        out[strategy] = entry
    return out


# ---- transport ---------------------------------------------------------------------------------------------
def summarize_transport(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw``: size -> rank 0's per-round lists (seconds). Medians (ms) and per-round ratios."""
    out = {}
    for size, rounds in raw.items():
        med = {k: median(v) for k, v in rounds.items()}
        entry = {"ms": {k: None if v is None else 1e3 * v for k, v in med.items()}}
        for push in ("both", "solo"):
            for ref in ("gloo", "memcpy", "echo"):
                if push in rounds and ref in rounds:
                    entry[f"{push}_vs_{ref}"] = median(ratios(rounds[push], rounds[ref]))
        out[size] = entry
    return out


def summarize_variants(raw: dict[str, Any], reference: str) -> dict[str, Any]:
    """TensorPipe settings: per setting and size, median ms and the per-round ratio to ``reference``."""
    times, errors = raw.get("times", {}), raw.get("errors", {})
    out: dict[str, Any] = {}
    for label, sizes in times.items():
        out[label] = {"error": errors.get(label)}
        for size, values in sizes.items():
            ref = times.get(reference, {}).get(size, [])
            out[label][size] = {
                "ms": None if median(values) is None else 1e3 * median(values),
                "vs_reference": median(ratios(values, ref)),
            }
    return out


def summarize_prototypes(rounds: list[dict[str, Any]], reference: str) -> dict[str, Any]:
    """``rounds``: per round, config label -> rank 0's measurements (one value per measure)."""
    labels = list(dict.fromkeys(label for r in rounds for label in r))
    out: dict[str, Any] = {}
    for label in labels:
        entry: dict[str, Any] = {}
        for measure in ("both", "solo", "pack", "pack_reuse", "server_update", "load", "memcpy", "clone"):
            values = [r.get(label, {}).get(measure) for r in rounds]
            if any(v is not None for v in values):
                ref = [r.get(reference, {}).get(measure) for r in rounds]
                entry[measure] = {"ms": 1e3 * median(values), "vs_reference": median(ratios(values, ref))}
        for push in ("both", "solo"):
            values = [r.get(label, {}).get(push) for r in rounds]
            mem = [r.get(label, {}).get("memcpy") for r in rounds]
            if push in entry:
                entry[f"{push}_vs_memcpy"] = median(ratios(values, mem))
        out[label] = entry
    return out
