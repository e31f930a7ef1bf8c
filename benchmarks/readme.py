"""The README's "Performance at a glance" table, made from the committed results files.

    python -m benchmarks.readme           # rewrites README.md between the perf-table markers
    python -m benchmarks.readme --check   # exits 1 if README.md differs from what it would write

Each row reads one results file, ``benchmarks/results/NAME.json`` (``ROWS``), and cites it with the commit and the
command it names. A results file of modified code, or of a commit not in HEAD's history, is refused: an error, and
nothing is written. A row whose results file (or whose configuration in it) is missing is left out, with a note
under the table. Beside every training ratio: the *ideal* one where there is one (no overhead, a straggler's bound)
and the ratio of the jobs' wall times (``job_vs_ddp``: start-up and teardown included).
"""

import argparse
import json
import os
import subprocess
import sys
from typing import Any, Callable, Optional

from benchmarks import provenance, stats
from benchmarks.config import M, STRATEGY_LABELS
from benchmarks.report import _f, _spread

START, END = "<!-- perf-table:start -->", "<!-- perf-table:end -->"
SLOWDOWN = 3  # the straggler of the README's rows


class Refused(Exception):
    """A results file the README must not cite, or a README without its markers."""


def _ratio(entry: dict[str, Any], key: str) -> str:
    """``0.63× (0.56–0.69)``: the median and the lowest and highest run's; ``–`` if not measured."""
    value = entry.get(key)
    return "–" if value is None else f"{value:.2f}×{_spread(entry.get(f'{key}_reps'))}"


def _each(runs: dict[str, Any], keys: tuple[str, ...], key: str) -> str:
    """The ratio ``key`` of each strategy of ``keys`` that ran, named."""
    cells = [f"{_name(k)} {_ratio(runs[k], key)}" for k in keys if k in runs]
    return "; ".join(cells) or "–"


def _name(key: str) -> str:
    return STRATEGY_LABELS.get(key, key).removeprefix("Rudra ")


def _find(configs: list[dict[str, Any]], **fields: Any) -> Optional[dict[str, Any]]:
    """The configuration with these fields (older results files have no ``target_params``: 10 M, nor
    ``server_node``)."""
    older = {"target_params": 10 * M, "server_node": False}
    return next((c for c in configs if all(c.get(k, older.get(k)) == v for k, v in fields.items())), None)


Row = list[str]  # what, measured, ideal, job / DDP's


def _epochs(s: dict[str, Any]) -> list[tuple[str, Optional[Row]]]:
    out = []
    for learners in (2, 4):
        what = f"epoch time, MNIST-1D, {learners} learners, one {SLOWDOWN}× slower, async (shared epoch) / DDP"
        c = _find(s.get("epochs", []), learners=learners, slowdown=SLOWDOWN)
        if c is None:
            out.append((what, None))
            continue
        a = c["runs"].get("async", {})
        tta = (
            f"; to {s['epochs_info']['target']} test accuracy: {_ratio(a, 'tta_vs_ddp')}"
            if "target" in s.get("epochs_info", {})
            else ""
        )
        out.append((what, [what, _ratio(a, "epoch_vs_ddp") + tta, f"{c['ideal']:.2f}×", _ratio(a, "job_vs_ddp")]))
    return out


def _accuracy(s: dict[str, Any]) -> list[tuple[str, Optional[Row]]]:
    out = []
    for learners in (4, 2):
        what = (
            f"time to the accuracy phase's target, MNIST-1D, {learners} learners, one {SLOWDOWN}× slower, async / DDP"
        )
        c = _find(s.get("accuracy", []), learners=learners, slowdown=SLOWDOWN)
        if c is None:
            out.append((what, None))
            continue
        a = c["runs"].get("async", {})
        never = a.get("tta_vs_ddp") is None and bool(a.get("tta_s_reps"))
        measured = (
            "never" if never else _ratio(a, "tta_vs_ddp")
        ) + f" (target {_f(c.get('target'), '{:.3f}')} test accuracy)"
        ideal = _f(c.get("ideal"), "{:.2f}×")
        out.append((what, [what, measured, ideal, _ratio(a, "job_vs_ddp")]))
    return out


def _transport(s: dict[str, Any]) -> list[tuple[str, Optional[Row]]]:
    what = "push+pull of 10 M parameters, 2 learners / a gloo all-reduce of the same bytes"
    one = s.get("transport", {}).get("rudra", {}).get(str(10 * M))
    if one is None:
        return [(what, None)]
    two = s["transport"].get("servers", {}).get("2", {}).get(str(10 * M), {})
    measured = _f(one.get("both_vs_gloo"), "{:.2f}×") + (
        f" (two servers: {two['both_vs_gloo']:.2f}×)" if two.get("both_vs_gloo") is not None else ""
    )
    return [(what, [what, measured, "–", "–"])]


def _models(s: dict[str, Any]) -> list[tuple[str, Optional[Row]]]:
    keys = ("hardsync", "async", "hardsync+rpc", "async+rpc", "hardsync+2servers", "async+2servers")
    what = "10 M-parameter MLP through the Trainer, 2 learners, samples/s / DDP's"
    straggling = f"the same with one learner {SLOWDOWN}× slower"
    c = _find(s.get("models", []), target_params=10 * M, learners=2)
    if c is None:
        return [(what, None), (straggling, None)]
    rows: list[tuple[str, Optional[Row]]] = [
        (what, [what, _each(c["runs"], keys, "vs_ddp"), "–", _each(c["runs"], keys, "job_vs_ddp")])
    ]
    if not c.get("straggler") or c.get("slowdown") != SLOWDOWN:
        return rows + [(straggling, None)]
    ideal = 1 / stats.ideal_epoch_ratio(c["learners"], c["slowdown"])  # the fast learner's rate and a third more
    st = c["straggler"]
    return rows + [
        (straggling, [straggling, _each(st, keys, "vs_ddp"), f"{ideal:.2f}×", _each(st, keys, "job_vs_ddp")])
    ]


def _network(s: dict[str, Any]) -> list[tuple[str, Optional[Row]]]:
    keys = ("hardsync", "async", "ddp+fp16", "hardsync+bf16", "async+bf16")
    out = []
    for per_host in (1, 2):
        what = f"10 M MLP, 2 hosts, link shaped to 1 Gbit/s, {per_host} learner{'s' * (per_host > 1)} per host, samples/s / DDP's"
        c = _find(
            s.get("network", []), rate="1gbit", learners_per_host=per_host, target_params=10 * M, server_node=False
        )
        if c is None:
            out.append((what, None))
            continue
        runs = c["runs"]
        measured = _each(runs, keys, "vs_ddp")
        compressed = [
            f"{_name(k)} {_ratio(runs[k], 'vs_ddp_fp16')}" for k in keys if runs.get(k, {}).get("vs_ddp_fp16")
        ]
        if compressed:
            measured += f"; against DDP with fp16_compress_hook: {'; '.join(compressed)}"
        out.append((what, [what, measured, "–", _each(runs, keys, "job_vs_ddp")]))
    return out


def _simulation(s: dict[str, Any]) -> list[tuple[str, Optional[Row]]]:
    sim = s.get("simulation")
    what = "simulated learners in one process, time / one plain Lightning process's"
    if sim is None:
        return [(what, None)]
    what = f"λ = {sim['learners']} {what}"
    measured = "; ".join(f"{name} {v:.2f}×{_spread(sim['vs_plain_reps'][name])}" for name, v in sim["vs_plain"].items())
    return [(what, [what, measured, "–", "–"])]


# results file -> its rows; a row None: its configuration is not in the file
ROWS: list[tuple[str, Callable[[dict[str, Any]], list[tuple[str, Optional[Row]]]]]] = [
    ("epochs", _epochs),
    ("accuracy", _accuracy),
    ("transport-models", _transport),
    ("transport-models", _models),
    ("network", _network),
    ("simulation", _simulation),
]


def load(name: str) -> Optional[dict[str, Any]]:
    """A results file (None if there is none), refused if its code was modified or its commit is not HEAD's or
    an ancestor of it."""
    path = os.path.join(provenance.RESULTS, f"{name}.json")
    if not os.path.exists(os.path.join(provenance.ROOT, path)):
        return None
    with open(os.path.join(provenance.ROOT, path)) as f:
        result = json.load(f)
    meta = result.get("meta", {})
    if meta.get("modified", meta.get("package_modified")):
        raise Refused(
            f"{path} was measured on modified code ({', '.join(meta.get('modified_files') or ['lightning_rudra'])} "
            f"differed from {meta.get('commit')}): rerun its command at a commit"
        )
    commit = meta.get("commit") or "?"
    ancestor = subprocess.run(
        ["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=provenance.ROOT, capture_output=True, timeout=30
    )
    if ancestor.returncode != 0:
        raise Refused(
            f"{path} names commit {commit}, which is not in HEAD's history: its numbers are of code this "
            "repository does not have; rerun its command"
        )
    return result


def table() -> str:
    """The markdown between the markers: the table, then a note of the rows left out."""
    lines = [
        "| what (against DDP, gloo) | measured | ideal | job wall time / DDP's | results file | command |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    missing = []
    results = {name: load(name) for name in dict.fromkeys(name for name, _ in ROWS)}
    for name, rows in ROWS:
        result = results[name]
        if result is None:
            missing += [f"{what} (no `{provenance.RESULTS}/{name}.json`)" for what, _ in rows({})]
            continue
        meta = result["meta"]
        source = f"[`{name}`]({provenance.RESULTS}/{name}.md) at {meta['commit'][:10]}"
        command = f"`{meta['command']}`" if meta.get("command") else "not recorded"
        for what, cells in rows(result["summary"]):
            if cells is None:
                missing.append(f"{what} (not in `{provenance.RESULTS}/{name}.json`)")
            else:
                lines.append("| " + " | ".join(cells + [source, command]) + " |")
    lines += [
        "",
        "Made by `python -m benchmarks.readme` from the results files named. Medians of per-run ratios, in brackets "
        "the lowest and highest run; *ideal*: the ratio without overhead; *job wall time*: each job's, start-up "
        "and teardown included, against DDP's (< 1: shorter).",
    ]
    if missing:
        lines += ["", "Left out, not measured: " + "; ".join(missing) + "."]
    return "\n".join(lines)


def render(readme: str) -> str:
    """``readme`` with the table between its markers replaced."""
    start, end = readme.find(START), readme.find(END)
    if start < 0 or end < start:
        raise Refused(f"README.md has no {START} ... {END} around its table")
    return readme[: start + len(START)] + "\n" + table() + "\n" + readme[end:]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md differs from what it would write")
    args = parser.parse_args(argv)
    path = os.path.join(provenance.ROOT, "README.md")
    with open(path) as f:
        readme = f.read()
    try:
        new = render(readme)
    except Refused as error:
        print(f"benchmarks.readme: refused: {error}", file=sys.stderr)
        return 2
    if args.check:
        if new != readme:
            print(
                "README.md's performance table differs from the results files: run python -m benchmarks.readme",
                file=sys.stderr,
            )
            return 1
        return 0
    with open(path, "w") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
