"""From raw measurements to medians, ratios, target checks and a markdown report.

Every ratio is taken within one round (numbers measured side by side in the same minute), and the median is
taken over rounds: on a shared machine that is far steadier than a ratio of two medians.
"""

import math
import statistics
from typing import Any, Optional

# the targets: (key, description, threshold, "<=" or ">=")
TARGETS = [
    ("transport_vs_gloo", "transport 10 M: push+pull round trip / gloo all-reduce", 1.5, "<="),
    ("transport_vs_memcpy", "transport 10 M: push+pull round trip / memcpy", 4.0, "<="),
    ("e2e_hardsync", "no straggler: hardsync samples/s / DDP", 0.9, ">="),
    ("e2e_softsync1", "no straggler: 1-softsync samples/s / DDP", 0.9, ">="),
    ("e2e_softsync2", "no straggler: 2-softsync samples/s / DDP", 0.9, ">="),
    ("e2e_async", "no straggler: async samples/s / DDP", 0.9, ">="),
    ("straggler_async", "one 3x straggler: async samples/s / DDP", 1.5, ">="),
    ("straggler_softsync2", "one 3x straggler: 2-softsync samples/s / DDP", 1.5, ">="),
    ("epochs_2x3", "2 learners, one 3x slower: async epoch time / DDP", 0.6, "<="),
    ("epochs_tta_2x3", "2 learners, one 3x slower: async time to accuracy / DDP", 0.7, "<="),
    ("epochs_4x3", "4 learners, one 3x slower: async epoch time / DDP", 0.5, "<="),
    ("models_10M_2_hardsync", "10 M MLP, 2 learners, no straggler: hardsync samples/s / DDP", 0.9, ">="),
    ("models_10M_2_async", "10 M MLP, 2 learners, no straggler: async samples/s / DDP", 1.0, ">="),
    ("models_10M_2_straggler_async", "10 M MLP, 2 learners, one 3x straggler: async samples/s / DDP", 2.0, ">="),
    ("accuracy_4x3", "4 learners, one 3x slower, momentum SGD: async time to DDP's accuracy / DDP", 0.6, "<="),
    ("accuracy_2x3", "2 learners, one 3x slower, momentum SGD: async time to DDP's accuracy / DDP", 0.6, "<="),
    (
        "network_aggregation_bytes",
        "2 hosts x 2 learners, 1 Gbit/s: hardsync link bytes per step, node aggregation / without",
        0.55,
        "<=",
    ),
    (
        "network_aggregation_vs_ddp",
        "2 hosts x 2 learners, 1 Gbit/s: hardsync (node aggregation) samples/s / DDP",
        1.3,
        ">=",
    ),
]

STRATEGY_LABELS = {
    "ddp": "DDP (gloo)",
    "hardsync": "Rudra hardsync",
    "softsync1": "Rudra 1-softsync",
    "softsync2": "Rudra 2-softsync",
    "async": "Rudra async",
}


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


def time_to_accuracy(rank0: dict[str, Any], target: float) -> tuple[Optional[float], Optional[float]]:
    """(seconds from the start of training to the first snapshot at or above ``target``, best accuracy)."""
    acc = rank0.get("accuracy") or []
    reached = next((t for t, a in acc if a >= target), None)
    return reached, max((a for _, a in acc), default=None)


def epoch_times(ranks: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Seconds per epoch: an epoch ends when its last learner ends it, and the first one is warm-up (process
    start, rendezvous, first allocations), so the times are between consecutive epoch ends. Under the shared
    epoch a fast learner does not wait at an epoch's end for a straggler, so these vary: ``epoch_ends_s`` (per
    rank, from the earliest train start) and ``epoch_batches`` (per rank and epoch) show how the learners'
    epochs overlap.

    And samples/s to the end: all learners' batches from the point where every learner is past ``warmup``
    batches to the end of the last epoch (its last learner's), so that every epoch's end and the waiting for the
    last learner count (``throughput``'s window ends when the first learner stops and leaves them out)."""
    epochs = min(len(r["epoch_ends"]) for r in ranks)
    ends = [max(r["epoch_ends"][e] for r in ranks) for e in range(epochs)]
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
                    "tta_s": median(tta),
                    "tta_s_reps": tta,
                    "tta_vs_ddp": median(tta_vs),
                    "tta_vs_ddp_reps": tta_vs,
                    "tta_reached": sum(t is not None for t in tta),
                    "best_accuracy": median([r.get("best_accuracy") for r in mine]),
                }
            )
        if any(r.get("epoch_s") is not None for r in mine):
            epoch = [r.get("epoch_s") for r in mine]
            epoch_vs = (
                [1.0] * len(mine) if strategy == baseline else ratios(epoch, [bracket(r, "epoch_s") for r in mine])
            )
            entry.update(
                {
                    "epoch_s": median(epoch),
                    "epoch_s_reps": epoch,
                    "epoch_vs_ddp": median(epoch_vs),
                    "epoch_vs_ddp_reps": epoch_vs,
                }
            )
        share = [r.get("straggler_share") for r in mine]
        if any(s is not None for s in share):
            entry["straggler_share"] = median(share)
        stale = [r.get("mean_staleness") for r in mine]
        if any(s is not None for s in stale):
            entry["mean_staleness"] = median(stale)
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


# ---- targets -----------------------------------------------------------------------------------------------
def model_key(config: dict[str, Any]) -> str:
    """The models phase's name for a configuration in ``TARGETS``: ``models_10M_2`` for 10 M, 2 learners."""
    return f"models_{config['target_params'] // 1_000_000}M_{config['learners']}"


def _link_total(entry: dict[str, Any]) -> Optional[float]:
    """Host 1's end of the link: bytes sent and received per step (median over runs)."""
    link = entry.get("link_per_step") or [{}, {}]
    ways = [link[1].get(way) for way in ("sent", "received")]
    return None if None in ways else sum(ways)


def check_targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    values: dict[str, Optional[float]] = {}
    tr = summary.get("transport", {}).get("rudra", {}).get(str(10_000_000), {})
    values["transport_vs_gloo"] = tr.get("both_vs_gloo")
    values["transport_vs_memcpy"] = tr.get("both_vs_memcpy")
    e2e = summary.get("e2e", {})
    for key in ("hardsync", "softsync1", "softsync2", "async"):
        values[f"e2e_{key}"] = e2e.get(key, {}).get("vs_ddp")
    strag = summary.get("straggler", {})
    for key in ("async", "softsync2"):
        values[f"straggler_{key}"] = strag.get(key, {}).get("vs_ddp")
    for config in summary.get("epochs", []):
        rudra = config["runs"].get("async", {})
        name = f"{config['learners']}x{config['slowdown']:g}"
        values[f"epochs_{name}"] = rudra.get("epoch_vs_ddp")
        values[f"epochs_tta_{name}"] = rudra.get("tta_vs_ddp")
    for config in summary.get("models", []):
        name = model_key(config)
        for key, entry in config["runs"].items():
            values[f"{name}_{key}"] = entry.get("vs_ddp")
        for key, entry in config.get("straggler", {}).items():
            values[f"{name}_straggler_{key}"] = entry.get("vs_ddp")
    for config in summary.get("network", []):
        if config["rate"] != "1gbit" or config["learners_per_host"] != 2:
            continue
        runs = config["runs"]
        values["network_aggregation_vs_ddp"] = runs.get("hardsync", {}).get("vs_ddp")
        with_, without = (_link_total(runs.get(key, {})) for key in ("hardsync", "hardsync+no_aggregation"))
        if with_ and without:
            values["network_aggregation_bytes"] = with_ / without
    never = set()  # measured, but the target accuracy never reached
    for config in summary.get("accuracy", []):
        name = f"accuracy_{config['learners']}x{config['slowdown']:g}"
        values[name] = config["runs"].get("async", {}).get("tta_vs_ddp")
        if values[name] is None and config["runs"].get("async", {}).get("tta_s_reps"):
            never.add(name)
    out = []
    for key, text, threshold, op in TARGETS:
        value = values.get(key)
        if value is None:
            out.append(
                {
                    "key": key,
                    "target": text,
                    "threshold": threshold,
                    "op": op,
                    "value": None,
                    "met": False if key in never else None,
                    "by": "missed: async never reached it" if key in never else "not measured",
                }
            )
            continue
        met = value <= threshold if op == "<=" else value >= threshold
        factor = value / threshold if op == "<=" else threshold / value  # > 1: how far off a missed target is
        by = (
            (
                f"met, {threshold / value:.2f}x better than needed"
                if op == "<="
                else f"met, {value / threshold:.2f}x the target"
            )
            if met
            else f"missed: {factor:.2f}x off"
        )
        out.append({"key": key, "target": text, "threshold": threshold, "op": op, "value": value, "met": met, "by": by})
    return out


# ---- rendering ---------------------------------------------------------------------------------------------
def _f(value: Optional[float], fmt: str = "{:.2f}") -> str:
    return "–" if value is None else fmt.format(value)


def _spread(values: Optional[list[Optional[float]]]) -> str:
    """`` (lowest–highest)`` of the per-repeat values, when there are several."""
    values = [v for v in values or [] if v is not None]
    return f" ({min(values):.2f}–{max(values):.2f})" if len(values) > 1 else ""


def _size_label(size: Any) -> str:
    n = int(size)
    return f"{n / 1e6:g} M" if n >= 1e6 else f"{n / 1e3:g} k"


def _threshold(key: str) -> str:
    return next((f"{op} {threshold:g}" for k, _, threshold, op in TARGETS if k == key), "–")


def _epochs_table(configs: list[dict[str, Any]], info: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## 5. Epochs with one straggler",
        "",
        info.get("text", ""),
        "",
        f"| learners (μ) | slowdown (sleep ms) | DDP epoch s | async epoch s | async / DDP (runs) | ideal | "
        f"target | straggler's share of batches (ideal) | time to {info.get('target', '?')} acc.: DDP s | "
        f"async s | async / DDP (runs) | target | reached (DDP, async) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in configs:
        ddp, rudra = c["runs"].get("ddp", {}), c["runs"].get("async", {})
        name = f"{c['learners']}x{c['slowdown']:g}"
        lines.append(
            f"| {c['learners']} ({c['batch_size']}) | {c['slowdown']:g}x ({c['sleep_ms']:.1f}) | "
            f"{_f(ddp.get('epoch_s'))} | {_f(rudra.get('epoch_s'))} | "
            f"{_f(rudra.get('epoch_vs_ddp'))}{_spread(rudra.get('epoch_vs_ddp_reps'))} | {c['ideal']:.3f} | "
            f"{_threshold(f'epochs_{name}')} | {_f(rudra.get('straggler_share'))} ({c['ideal'] / c['learners']:.2f}) | "
            f"{_f(ddp.get('tta_s'))} | {_f(rudra.get('tta_s'))} | "
            f"{_f(rudra.get('tta_vs_ddp'))}{_spread(rudra.get('tta_vs_ddp_reps'))} | "
            f"{_threshold(f'epochs_tta_{name}')} | {ddp.get('tta_reached', 0)}/{ddp.get('runs', 0)}, "
            f"{rudra.get('tta_reached', 0)}/{rudra.get('runs', 0)} |"
        )
    return lines


def _models_table(configs: list[dict[str, Any]], info: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## 6. Real model sizes",
        "",
        info.get("text", ""),
        "",
        "| model | learners (μ) | straggler (sleep ms) | strategy | samples/s | vs DDP (runs) | target | "
        "step ms (rank 0) | epoch s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in configs:
        name = model_key(c)
        rows = [("–", key, e, _threshold(f"{name}_{key}")) for key, e in c["runs"].items()]
        if c.get("sleep_ms") is not None:
            straggler = f"{c['slowdown']:g}x ({c['sleep_ms']:.1f})"
            rows += [(straggler, key, e, _threshold(f"{name}_straggler_{key}")) for key, e in c["straggler"].items()]
        for straggler, key, e, target in rows:
            lines.append(
                f"| MLP {c['parameters'] / 1e6:.1f} M | {c['learners']} ({c['batch_size']}) | {straggler} | "
                f"{STRATEGY_LABELS.get(key, key)} | {_f(e['samples_per_s'], '{:.0f}')} | "
                f"{_f(e['vs_ddp'])}{_spread(e.get('vs_ddp_reps'))} | {target} | "
                f"{_f(e['step_ms'], '{:.1f}')} | {_f(e.get('epoch_s'))} |"
            )
    return lines


def _accuracy_table(configs: list[dict[str, Any]], info: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## 7. Time to DDP's accuracy, momentum SGD",
        "",
        info.get("text", ""),
        "",
        "| learners (μ) | straggler (sleep ms) | DDP final acc. (runs) | target | DDP s to target (epochs) | "
        "async s to target (epochs) | async / DDP (runs) | needed | async best acc. | async final acc. (runs) | "
        "reached (DDP, async) | epochs run (DDP, async) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in configs:
        ddp, rudra = c["runs"].get("ddp", {}), c["runs"].get("async", {})
        acc = lambda e, k: _f(e.get(k), "{:.3f}")  # noqa: E731
        never = rudra.get("tta_vs_ddp") is None and bool(rudra.get("tta_s_reps"))
        cells = [
            f"{c['learners']} ({c['batch_size']})",
            f"{c['slowdown']:g}x ({c['sleep_ms']:.1f})" if c["slowdown"] > 1 else "none",
            acc(c, "ddp_final_accuracy") + _spread(ddp.get("final_accuracy_runs")),
            acc(c, "target"),
            f"{_f(ddp.get('tta_s'))} ({_f(ddp.get('tta_epochs'), '{:.1f}')})",
            f"{_f(rudra.get('tta_s')) if rudra.get('tta_s') is not None else 'never'} "
            f"({_f(rudra.get('tta_epochs'), '{:.1f}')})",
            ("never" if never else _f(rudra.get("tta_vs_ddp"))) + _spread(rudra.get("tta_vs_ddp_reps")),
            _threshold(f"accuracy_{c['learners']}x{c['slowdown']:g}"),
            acc(rudra, "best_accuracy"),
            acc(rudra, "final_accuracy") + _spread(rudra.get("final_accuracy_runs")),
            f"{ddp.get('tta_reached', 0)}/{ddp.get('runs', 0)}, {rudra.get('tta_reached', 0)}/{rudra.get('runs', 0)}",
            f"{_f(ddp.get('epochs_trained'), '{:g}')}, {_f(rudra.get('epochs_trained'), '{:g}')}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _network_table(configs: list[dict[str, Any]], info: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## 8. Across two hosts, the link shaped",
        "",
        info.get("text", ""),
        "",
        "| link | learners per host (μ) | strategy | samples/s | vs DDP (runs) | epoch s | host 1 MB per step, "
        "sent / received | × model |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in configs:
        model_mb = 4 * c["parameters"] / 1e6
        for key, e in c["runs"].items():
            link = e.get("link_per_step") or [{}, {}]
            sent, received = (link[1].get(way) for way in ("sent", "received"))
            mb = [None if x is None else x / 1e6 for x in (sent, received)]
            per_host = (
                "2 on host 0, 0 on host 1" if c.get("server_node") and "server_node" in key else c["learners_per_host"]
            )
            lines.append(
                f"| {c['rate']} | {per_host} ({c['batch_size']}) | {STRATEGY_LABELS.get(key, key)} | "
                f"{_f(e['samples_per_s'], '{:.0f}')} | {_f(e['vs_ddp'])}{_spread(e.get('vs_ddp_reps'))} | "
                f"{_f(e.get('epoch_s'))} | {_f(mb[0], '{:.1f}')} / {_f(mb[1], '{:.1f}')} | "
                f"{_f(None if mb[0] is None else mb[0] / model_mb)} / "
                f"{_f(None if mb[1] is None else mb[1] / model_mb)} |"
            )
    return lines


def render_markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    meta = result["meta"]
    lines = [
        f"# lightning_rudra benchmark ({meta['mode']})",
        "",
        f"{meta['date']} · lightning_rudra at {meta.get('commit', '?')}"
        f"{' (modified)' if meta.get('package_modified') else ''} · {meta['nproc']} CPUs ({meta['cpu_model']}) · torch {meta['torch']} · "
        f"pytorch-lightning {meta['lightning']} · python {meta['python']} · {meta['duration_s']:.0f} s · "
        f"load average {meta['loadavg_start'][0]:.1f} at the start, {meta['loadavg_end'][0]:.1f} at the end",
        "",
    ]

    lines += ["## Targets", "", "| target | needed | measured | result |", "|---|---|---|---|"]
    for t in s["targets"]:
        lines.append(f"| {t['target']} | {t['op']} {t['threshold']:g} | {_f(t['value'])} | {t['by']} |")

    tr = s.get("transport", {})
    if tr.get("rudra"):
        lines += [
            "",
            "## 1. Transport: one synchronisation of N float32 between 2 processes",
            "",
            "Medians in ms. *push+pull, 2 learners*: both learners step at once (`Learner.push`: pack, RPC "
            "to the server, async update, weights back, load), the time one learner waits; *1 learner*: "
            "learner 1 idle. *RPC echo*: the same bytes to the same server process and back, no work. "
            "Ratios are per round, then the median.",
            "",
            "| N | push+pull, 2 learners | push+pull, 1 learner | RPC echo | gloo all-reduce | memcpy | "
            "copy to new memory | 2 learners / gloo | 2 learners / memcpy | 1 learner / gloo | "
            "1 learner / memcpy |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for size, e in tr["rudra"].items():
            ms = e["ms"]
            lines.append(
                f"| {_size_label(size)} | {_f(ms.get('both'), '{:.1f}')} | {_f(ms.get('solo'), '{:.1f}')} | "
                f"{_f(ms.get('echo'), '{:.1f}')} | {_f(ms.get('gloo'), '{:.1f}')} | "
                f"{_f(ms.get('memcpy'), '{:.1f}')} | {_f(ms.get('clone'), '{:.1f}')} | "
                f"{_f(e.get('both_vs_gloo'))} | {_f(e.get('both_vs_memcpy'))} | "
                f"{_f(e.get('solo_vs_gloo'))} | {_f(e.get('solo_vs_memcpy'))} |"
            )
        for servers, sizes in tr.get("servers", {}).items():
            lines += [
                "",
                f"With `num_servers={servers}` (each server process owns a contiguous part of the "
                "parameter), in jobs of their own, after the one above, each with its own gloo and memcpy "
                "references:",
                "",
                "| N | push+pull, 2 learners | push+pull, 1 learner | gloo all-reduce | memcpy | "
                "2 learners / gloo | 2 learners / memcpy | 1 learner / memcpy |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for size, e in sizes.items():
                ms = e["ms"]
                lines.append(
                    f"| {_size_label(size)} | {_f(ms.get('both'), '{:.1f}')} | {_f(ms.get('solo'), '{:.1f}')} | "
                    f"{_f(ms.get('gloo'), '{:.1f}')} | {_f(ms.get('memcpy'), '{:.1f}')} | "
                    f"{_f(e.get('both_vs_gloo'))} | {_f(e.get('both_vs_memcpy'))} | "
                    f"{_f(e.get('solo_vs_memcpy'))} |"
                )
        lines += [
            "",
            "Where one push goes, measured in-process on learner 0 (ms): *pack* the gradient into one "
            "flat buffer; *server update* = `Server.push` (checks, async SGD step) + `Server.pull` (copy of "
            "the weights for the reply); *load* the reply into the parameters. The rest of a 1-learner "
            "push is the RPC (compare *RPC echo*).",
            "",
            "| N | pack | server update | load | RPC echo | sum | push+pull, 1 learner | pack into a reused buffer |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for size, e in tr["rudra"].items():
            ms = e["ms"]
            parts = [ms.get(k) for k in ("pack", "server_update", "load", "echo")]
            total = sum(parts) if all(p is not None for p in parts) else None
            lines.append(
                f"| {_size_label(size)} | "
                + " | ".join(_f(p, "{:.1f}") for p in parts)
                + f" | {_f(total, '{:.1f}')} | {_f(ms.get('solo'), '{:.1f}')} | "
                f"{_f(ms.get('pack_reuse'), '{:.1f}')} |"
            )
    if tr.get("variants"):
        ref = tr.get("variants_reference")
        sizes = [k for k in next(iter(tr["variants"].values())) if k != "error"]
        lines += [
            "",
            "## TensorPipe settings: bare RPC round trip between the two workers (prototype)",
            "",
            f"Median ms (ratio to `{ref}`, the setting lightning_rudra pins). `shm` busy-polls: it "
            "burns a core per process while idle.",
            "",
            "| setting | " + " | ".join(_size_label(x) for x in sizes) + " |",
            "|---|" + "---|" * len(sizes),
        ]
        for label, e in tr["variants"].items():
            if e.get("error"):
                lines.append(f"| {label} | " + " | ".join("failed" for _ in sizes) + f" |  <!-- {e['error']} -->")
                continue
            cells = [f"{_f(e[x]['ms'], '{:.1f}')} ({_f(e[x]['vs_reference'])}x)" for x in sizes]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if tr.get("prototypes"):
        ref = tr.get("prototypes_reference")
        lines += [
            "",
            "## Prototype fixes, 10 M push+pull (ms, and ratio to the package as it is)",
            "",
            "See `benchmarks/proto.py`. *THP*: `THP_MEM_ALLOC_ENABLE=1` (torch then asks for transparent huge "
            "pages for large tensors) in the server process's environment, or in every process's. *pack into "
            "reused buffers*: the learner packs its gradient into two buffers it keeps (alternating) instead of "
            "new memory. *pack*, *server update* and *copy to new memory* are the in-process measurements on "
            "learner 0 (its environment).",
            "",
            "| configuration | 2 learners | 1 learner | 2 learners / memcpy | pack | server update | "
            "copy to new memory |",
            "|---|---|---|---|---|---|---|",
        ]
        for label, e in tr["prototypes"].items():

            def cell(m: str, e: dict = e) -> str:
                return f"{_f(e[m]['ms'], '{:.1f}')} ({_f(e[m]['vs_reference'])}x)" if m in e else "–"

            lines.append(
                f"| {label} | {cell('both')} | {cell('solo')} | {_f(e.get('both_vs_memcpy'))} | "
                f"{cell('pack')} | {cell('server_update')} | {cell('clone')} |"
            )

    for section, title, with_tta in (
        ("e2e", "2 & 4. End to end, no straggler", True),
        ("straggler", "3. One learner 3x slower", False),
    ):
        rows = s.get(section)
        if not rows:
            continue
        info = s.get(f"{section}_info", {})
        lines += ["", f"## {title}", "", info.get("text", ""), ""]
        header = "| strategy | samples/s | vs DDP (lowest–highest run) | step ms (rank 0) | mean σ |"
        sep = "|---|---|---|---|---|"
        if with_tta:
            header += f" time to {info.get('target', '?')} test acc. (s) | vs DDP (time; < 1 is faster) | reached | best acc. |"
            sep += "---|---|---|---|"
        lines += [header, sep]
        for key, e in rows.items():
            row = (
                f"| {STRATEGY_LABELS.get(key, key)} | {_f(e['samples_per_s'], '{:.0f}')} | "
                f"{_f(e['vs_ddp'])}{_spread(e.get('vs_ddp_reps'))} | "
                f"{_f(e['step_ms'], '{:.1f}')} | {_f(e.get('mean_staleness'))} |"
            )
            if with_tta:
                row += (
                    f" {_f(e.get('tta_s'))} | {_f(e.get('tta_vs_ddp'))}{_spread(e.get('tta_vs_ddp_reps'))} | "
                    f"{e.get('tta_reached', 0)}/"
                    f"{len(e.get('tta_s_reps', []))} | {_f(e.get('best_accuracy'), '{:.3f}')} |"
                )
            lines.append(row)
    if s.get("epochs"):
        lines += _epochs_table(s["epochs"], s.get("epochs_info", {}))
    if s.get("models"):
        lines += _models_table(s["models"], s.get("models_info", {}))
    if s.get("accuracy"):
        lines += _accuracy_table(s["accuracy"], s.get("accuracy_info", {}))
    if s.get("network"):
        lines += _network_table(s["network"], s.get("network_info", {}))
    if result.get("failures"):
        lines += ["", "## Failures", ""] + [f"- {f}" for f in result["failures"]]
    return "\n".join(lines) + "\n"
