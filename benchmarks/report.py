"""The markdown report of a run (``render_markdown``): the targets, then a section per phase measured.

``python -m benchmarks.report RESULTS.json`` renders a committed results file again (to stdout).
"""

import argparse
import json
from typing import Any, Optional

from benchmarks.config import STRATEGIES, STRATEGY_LABELS
from benchmarks.hosts import rate_bits
from benchmarks.targets import TARGETS, accuracy_key, check_targets, model_key, straggler_key


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


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(paragraphs: list[str], columns: str, rows: list[list[str]]) -> list[str]:
    """A report's table: each of ``paragraphs`` (a section's title, its text) after an empty line, then the
    header (``columns``: the column names between " | ") and a line per row of cells."""
    lines = [line for paragraph in paragraphs for line in ("", paragraph)]
    header = columns.split(" | ")
    return lines + ["", _row(header), "|" + "---|" * len(header)] + [_row(cells) for cells in rows]


def _section(title: str, info: dict[str, Any], columns: str, rows: list[list[str]]) -> list[str]:
    """A phase's section: its title, the text the phase wrote (``info``) and its table."""
    return _table([f"## {title}", info.get("text", "")], columns, rows)


def _vs(entry: dict[str, Any], key: str = "vs_ddp") -> str:
    """A median ratio and the lowest and highest run's."""
    return f"{_f(entry.get(key))}{_spread(entry.get(f'{key}_reps'))}"


def _job(entry: dict[str, Any]) -> list[str]:
    """The job's wall time (start-up and teardown included) and its ratio to DDP's, as cells."""
    return [_f(entry.get("job_wall_s"), "{:.1f}"), _vs(entry, "job_vs_ddp")]


def _reached(ddp: dict[str, Any], rudra: dict[str, Any]) -> str:
    return f"{ddp.get('tta_reached', 0)}/{ddp.get('runs', 0)}, {rudra.get('tta_reached', 0)}/{rudra.get('runs', 0)}"


def _straggler(config: dict[str, Any]) -> str:
    """A row's straggler: k, how it spends its delay (results from before busy-waiting ones slept) and the delay."""
    if config["slowdown"] <= 1:
        return "none"
    return f"{config['slowdown']:g}x {config.get('straggle') or 'sleep'} ({config['sleep_ms']:.1f})"


def _epochs_table(configs: list[dict[str, Any]], info: dict[str, Any]) -> list[str]:
    columns = (
        "learners (μ) | straggler (delay ms) | DDP epoch s | async epoch s | async / DDP (runs) | ideal | "
        f"target | straggler's share of batches (ideal) | time to {info.get('target', '?')} acc.: DDP s | "
        "async s | async / DDP (runs) | ideal (epoch time) | target | reached (DDP, async) | job: async / DDP (runs)"
    )
    rows = []
    for c in configs:
        ddp, rudra = c["runs"].get("ddp", {}), c["runs"].get("async", {})
        name = straggler_key(c)
        rows.append(
            [
                f"{c['learners']} ({c['batch_size']})",
                _straggler(c),
                _f(ddp.get("epoch_s")),
                _f(rudra.get("epoch_s")),
                _vs(rudra, "epoch_vs_ddp"),
                f"{c['ideal']:.3f}",
                _threshold(f"epochs_{name}"),
                f"{_f(rudra.get('straggler_share'))} ({c['ideal'] / c['learners']:.2f})",
                _f(ddp.get("tta_s")),
                _f(rudra.get("tta_s")),
                _vs(rudra, "tta_vs_ddp"),
                f"{c['ideal']:.3f}",
                _threshold(f"epochs_tta_{name}"),
                _reached(ddp, rudra),
                _vs(rudra, "job_vs_ddp"),
            ]
        )
    return _section("5. Epochs with one straggler", info, columns, rows)


def _models_table(configs: list[dict[str, Any]], info: dict[str, Any]) -> list[str]:
    columns = (
        "model | learners (μ) | straggler (sleep ms) | strategy | samples/s | vs DDP (runs) | target | "
        "step ms (rank 0) | epoch s | job s | job / DDP (runs)"
    )
    rows = []
    for c in configs:
        name = model_key(c)
        runs = [("–", key, e, _threshold(f"{name}_{key}")) for key, e in c["runs"].items()]
        if c.get("sleep_ms") is not None:
            straggler = f"{c['slowdown']:g}x ({c['sleep_ms']:.1f})"
            runs += [(straggler, key, e, _threshold(f"{name}_straggler_{key}")) for key, e in c["straggler"].items()]
        for straggler, key, e, target in runs:
            rows.append(
                [
                    f"MLP {c['parameters'] / 1e6:.1f} M",
                    f"{c['learners']} ({c['batch_size']})",
                    straggler,
                    STRATEGY_LABELS.get(key, key),
                    _f(e["samples_per_s"], "{:.0f}"),
                    _vs(e),
                    target,
                    _f(e["step_ms"], "{:.1f}"),
                    _f(e.get("epoch_s")),
                    *_job(e),
                ]
            )
    return _section("6. Real model sizes", info, columns, rows)


def rudra_name(keys: list[str]) -> str:
    """How the accuracy table's columns name the Rudra strategy: its key where there is one (``async``, as in
    results from before the phase took others), "Rudra" where each row names its own."""
    return keys[0] if len(keys) == 1 else "Rudra"


def _rudra_rows(configs: list[dict[str, Any]]) -> tuple[list[str], list[tuple[dict[str, Any], str]]]:
    """The accuracy phase's Rudra strategies (every key but DDP's, in the order they ran) and its rows: one per
    configuration and strategy."""
    keys = list(dict.fromkeys(k for c in configs for k in c["runs"] if k != "ddp"))
    return keys, [(c, k) for c in configs for k in keys if k in c["runs"]]


def _accuracy_table(configs: list[dict[str, Any]], info: dict[str, Any]) -> list[str]:
    keys, pairs = _rudra_rows(configs)
    name = rudra_name(keys)
    columns = (
        "learners (μ) | straggler (delay ms) | "
        + ("strategy | " if len(keys) > 1 else "")
        + f"DDP plateau (runs) | DDP, half the epochs | target | DDP s to target (epochs) | {name} s to target "
        f"(epochs) | {name} / DDP (runs) | ideal (epoch time) | needed | job: {name} / DDP (runs) | {name} final acc. "
        f"(runs) | reached (DDP, {name})"
    )
    rows = []
    acc = lambda e, k: _f(e.get(k), "{:.3f}")  # noqa: E731
    for c, key in pairs:
        ddp, rudra = c["runs"].get("ddp", {}), c["runs"][key]
        never = rudra.get("tta_vs_ddp") is None and bool(rudra.get("tta_s_reps"))
        rows.append(
            [f"{c['learners']} ({c['batch_size']})", _straggler(c)]
            + ([STRATEGY_LABELS.get(key, key)] if len(keys) > 1 else [])
            + [
                acc(c, "ddp_plateau") + _spread(c.get("ddp_plateau_runs")),
                acc(c, "ddp_half_accuracy"),
                acc(c, "target"),
                f"{_f(ddp.get('tta_s'))} ({_f(ddp.get('tta_epochs'), '{:.1f}')})",
                f"{_f(rudra.get('tta_s')) if rudra.get('tta_s') is not None else 'never'} "
                f"({_f(rudra.get('tta_epochs'), '{:.1f}')})",
                ("never" if never else _f(rudra.get("tta_vs_ddp"))) + _spread(rudra.get("tta_vs_ddp_reps")),
                # the shared epoch's ideal holds where every gradient is applied as it comes (async, softsync), not
                # where a round waits (hardsync) or drops late ones (batchsync, backup)
                _f(c.get("ideal"), "{:.3f}") if STRATEGIES.get(key, (key,))[0] in ("async", "softsync") else "–",
                _threshold(accuracy_key(c, key)),
                _vs(rudra, "job_vs_ddp"),
                acc(rudra, "final_accuracy") + _spread(rudra.get("final_accuracy_runs")),
                _reached(ddp, rudra),
            ]
        )
    lines = _section("7. Time to DDP's accuracy, momentum SGD", info, columns, rows)
    lines += _epochs_to_target(pairs)
    sweep = info.get("sweep")
    if sweep:  # DDP's rate: every rate tried, the chosen one in bold
        lines += _table(
            [
                f"DDP's rate sweep: validation accuracy of the final weights after {sweep['epochs']} epochs, mean "
                f"(lowest–highest) over {sweep['orders']} data order(s)"
            ],
            "lr | validation accuracy",
            [
                [f"**{s['lr']:g}**" if s["lr"] == sweep["lr"] else f"{s['lr']:g}"]
                + [f"{s['val_accuracy']:.3f}{_spread(s['val_accuracy_runs'])}"]
                for s in sweep["scores"]
            ],
        )
    return lines


def _epochs_to_target(pairs: list[tuple[dict[str, Any], str]]) -> list[str]:
    """The accuracy phase's second table: per row, the epochs to the target against DDP's, the accuracy over half
    the epochs beside DDP's, and the gradients that came too late for their round; none in results from before it
    was measured."""
    pairs = [(c, k) for c, k in pairs if "tta_epochs_vs_ddp" in c["runs"][k]]
    if not pairs:
        return []
    rows = []
    for c, key in pairs:
        ddp, rudra = c["runs"].get("ddp", {}), c["runs"][key]
        never = rudra.get("tta_epochs_vs_ddp") is None and bool(rudra.get("tta_s_reps"))
        late = _f(rudra.get("late"), "{:.0f}") + (f" ({rudra['late_share']:.2f})" if "late_share" in rudra else "")
        rows.append(
            [
                f"{c['learners']} ({c['batch_size']})",
                _straggler(c),
                STRATEGY_LABELS.get(key, key),
                f"{_f(rudra.get('tta_epochs'), '{:.1f}')} ({_f(ddp.get('tta_epochs'), '{:.1f}')})",
                ("never" if never else _f(rudra.get("tta_epochs_vs_ddp")))
                + _spread(rudra.get("tta_epochs_vs_ddp_reps")),
                _threshold(accuracy_key(c, key, "epochs")),
                f"{_f(rudra.get('half_accuracy'), '{:.3f}')} ({_f(c.get('ddp_half_accuracy'), '{:.3f}')})",
                _f(rudra.get("mean_staleness")),
                late,
                _f(rudra.get("redealt"), "{:.0f}"),
            ]
        )
    return _table(
        ["Epochs to DDP's accuracy, and the rounds' late gradients (medians over runs)"],
        "learners (μ) | straggler (delay ms) | strategy | epochs to target (DDP's) | epochs / DDP's (runs) | needed | "
        "accuracy over half the epochs (DDP's) | mean σ | late gradients per run (share of pushes) | batches dealt "
        "again per run",
        rows,
    )


def _network_table(configs: list[dict[str, Any]], info: dict[str, Any]) -> list[str]:
    columns = (
        "link | model | learners per host (μ) | strategy | samples/s | vs DDP (runs) | vs DDP fp16 (runs) | epoch s | "
        "host 1 MB per step, sent / received | × model | step s: compute / link / all | link hidden (most) | "
        "job s | job / DDP (runs)"
    )
    rows = []
    for c in configs:
        model_mb = 4 * c["parameters"] / 1e6
        for key, e in c["runs"].items():
            link = e.get("link_per_step") or [{}, {}]
            mb = [None if link[1].get(way) is None else link[1][way] / 1e6 for way in ("sent", "received")]
            share = [None if x is None else x / model_mb for x in mb]
            times, hidden = _link_hidden(c, e, mb)
            rows.append(
                [
                    c["rate"],
                    f"MLP {c['parameters'] / 1e6:.1f} M",
                    f"{_placement(c, key)} ({c['batch_size']})",
                    STRATEGY_LABELS.get(key, key),
                    _f(e["samples_per_s"], "{:.0f}"),
                    _vs(e),
                    _vs(e, "vs_ddp_fp16"),
                    _f(e.get("epoch_s")),
                    f"{_f(mb[0], '{:.1f}')} / {_f(mb[1], '{:.1f}')}",
                    f"{_f(share[0])} / {_f(share[1])}",
                    times,
                    hidden,
                    *_job(e),
                ]
            )
    return _section("8. Across two hosts, the link shaped", info, columns, rows)


def _link_hidden(config: dict[str, Any], entry: dict[str, Any], mb: list[Optional[float]]) -> tuple[str, str]:
    """The profile of a network row (issue 34): a learner's step in seconds, its forward and backward pass alone
    (*compute*: ``compute_s``), the least time its bytes take on the link (*link*: the larger of host 1's MB sent
    and received per step, at the link's rate) and the whole step (*all*: λμ / samples/s); and the share of the
    link time hidden behind compute, (compute + link − all) / link (none where negative: the step took longer than
    both one after the other), beside the most that could be hidden, min(compute, link) / link."""
    compute, sent, received = entry.get("compute_s"), *mb
    if compute is None or sent is None or received is None or not entry.get("samples_per_s"):
        return "–", "–"
    learners = 2 * config["learners_per_host"] if isinstance(config["learners_per_host"], int) else 2
    step = learners * config["batch_size"] / entry["samples_per_s"]
    link = max(sent, received) * 1e6 * 8 / rate_bits(config["rate"])
    hidden = max(0.0, compute + link - step) / link
    return f"{compute:.3f} / {link:.3f} / {step:.3f}", f"{hidden:.0%} ({min(compute, link) / link:.0%})"


def _placement(config: dict[str, Any], key: str) -> Any:
    """Learners per host of a network row; the server-node layout's own runs say where theirs are."""
    return (
        "2 on host 0, 0 on host 1"
        if config.get("server_node") and "server_node" in key
        else config["learners_per_host"]
    )


def _runs_table(title: str, info: dict[str, Any], entries: dict[str, Any], with_tta: bool) -> list[str]:
    """Sections 2 to 4: per strategy, samples/s against DDP (and the time to accuracy)."""
    columns = (
        "strategy | samples/s | vs DDP (lowest–highest run) | step ms (rank 0) | mean σ | job s | job / DDP (runs)"
    )
    if with_tta:
        columns += (
            f" | time to {info.get('target', '?')} test acc. (s) | vs DDP (time; < 1 is faster) | reached | best acc."
        )
    rows = []
    for key, e in entries.items():
        cells = [
            STRATEGY_LABELS.get(key, key),
            _f(e["samples_per_s"], "{:.0f}"),
            _vs(e),
            _f(e["step_ms"], "{:.1f}"),
            _f(e.get("mean_staleness")),
            *_job(e),
        ]
        if with_tta:
            cells += [
                _f(e.get("tta_s")),
                _vs(e, "tta_vs_ddp"),
                f"{e.get('tta_reached', 0)}/{len(e.get('tta_s_reps', []))}",
                _f(e.get("best_accuracy"), "{:.3f}"),
            ]
        rows.append(cells)
    return _section(title, info, columns, rows)


def _commit(meta: dict[str, Any]) -> str:
    """The commit, and the files modified (older results files say only whether lightning_rudra/ was)."""
    if meta.get("modified", meta.get("package_modified")):
        return (
            f"{meta.get('commit', '?')[:12]} (modified: {', '.join(meta.get('modified_files') or ['lightning_rudra'])})"
        )
    return meta.get("commit", "?")[:12]


def render_markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    meta = result["meta"]
    lines = [
        f"# lightning_rudra benchmark ({meta['mode']})",
        "",
        f"{meta['date']} · lightning_rudra at {_commit(meta)} · {meta['nproc']} CPUs ({meta['cpu_model']}) · "
        f"torch {meta['torch']} · pytorch-lightning {meta['lightning']} · python {meta['python']} · "
        f"{meta['duration_s']:.0f} s · load average {meta['loadavg_start'][0]:.1f} at the start, "
        f"{meta['loadavg_end'][0]:.1f} at the end" + (f" · `{meta['command']}`" if meta.get("command") else ""),
    ]
    lines += _table(
        ["## Targets"],
        "target | needed | measured | result",
        [[t["target"], f"{t['op']} {t['threshold']:g}", _f(t["value"]), t["by"]] for t in s["targets"]],
    )
    from benchmarks import transport_report  # imports this module's helpers

    tr = s.get("transport", {})
    if tr.get("rudra"):
        lines += transport_report.transport_tables(tr)
    if tr.get("variants"):
        lines += transport_report.variants_table(tr)
    if tr.get("prototypes"):
        lines += transport_report.prototypes_table(tr)
    for section, title, with_tta in (
        ("e2e", "2 & 4. End to end, no straggler", True),
        ("straggler", "3. One learner 3x slower", False),
    ):
        if s.get(section):
            lines += _runs_table(title, s.get(f"{section}_info", {}), s[section], with_tta)
    for section, table in (
        ("epochs", _epochs_table),
        ("models", _models_table),
        ("accuracy", _accuracy_table),
        ("network", _network_table),
    ):
        if s.get(section):
            lines += table(s[section], s.get(f"{section}_info", {}))
    if result.get("failures"):
        lines += ["", "## Failures", ""] + [f"- {f}" for f in result["failures"]]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> None:
    """Print the report of each results file named (``benchmarks/results/NAME.json``) again, from its numbers."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("results", nargs="+", help="a results file, e.g. benchmarks/results/network.json")
    for path in parser.parse_args(argv).results:
        with open(path) as f:
            result = json.load(f)
        result["summary"].setdefault("targets", check_targets(result["summary"]))
        print(render_markdown(result), end="")


if __name__ == "__main__":
    main()
