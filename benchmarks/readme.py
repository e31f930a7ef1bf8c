"""The README's "Performance at a glance" table, made from the committed results files.

    python -m benchmarks.readme           # rewrites README.md between the perf-table markers
    python -m benchmarks.readme --check   # exits 1 if README.md differs from what it would write

Each row reads one results file, ``benchmarks/results/NAME.json`` (``ROWS``), and cites it with the commit it names
(the file's report names its command). A results file of modified code, or of a commit not in HEAD's history, is refused: an error, and
nothing is written. A row whose results file (or whose configuration in it) is missing is left out, with a note
under the table. Beside every training ratio: the *ideal* one where there is one (no overhead, a straggler's bound)
and the ratio of the jobs' wall times (``job_vs_ddp``: start-up and teardown included).
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from typing import Any, Callable, Optional

from benchmarks import provenance, stats
from benchmarks.config import M
from benchmarks.report import _f

START, END = "<!-- perf-table:start -->", "<!-- perf-table:end -->"
STUDY = "docs/study/staleness/runs.jsonl"  # the staleness study's runs (examples/study/staleness.py)
SLOWDOWN = 3  # the straggler of the README's rows


class Refused(Exception):
    """A results file the README must not cite, or a README without its markers."""


# how a row names a strategy (short: README.md is read in ten minutes, at most 12 KiB)
NAMES = {
    "hardsync": "hardsync",
    "async": "async",
    "hardsync+rpc": "hardsync via RPC",
    "async+rpc": "async via RPC",
    "ddp+fp16": "DDP fp16",
    "hardsync+bf16": "hardsync bf16",
    "async+bf16": "async bf16",
    "hardsync+buckets+8servers": "4 servers per host, `bucket_cap_mb=4`",
}


def _x(value: Optional[float]) -> str:
    return _f(value, "{:.2f}×")


def _each(runs: dict[str, Any], keys: tuple[str, ...], key: str, more: str = "") -> str:
    """The ratio ``key`` of each strategy of ``keys`` that ran, named (and ``more``: a second ratio, in brackets)."""
    cells = []
    for k in (k for k in keys if k in runs):
        extra = runs[k].get(more) if more else None
        cells.append(f"{NAMES[k]} {_x(runs[k].get(key))}" + (f" ({_x(extra)} DDP fp16)" if extra is not None else ""))
    return ", ".join(cells) or "–"


def _jobs(runs: dict[str, Any], keys: tuple[str, ...]) -> str:
    """``job_vs_ddp`` of the strategies ``_each`` names, in its order (unnamed: the README's bytes are few)."""
    return ", ".join(_x(runs[k].get("job_vs_ddp")) for k in keys if k in runs) or "–"


def _find(configs: list[dict[str, Any]], **fields: Any) -> Optional[dict[str, Any]]:
    """The configuration with these fields (older results files have no ``target_params``: 10 M, nor
    ``server_node``, nor ``straggle``: their stragglers slept)."""
    older = {"target_params": 10 * M, "server_node": False, "straggle": "sleep"}
    return next((c for c in configs if all(c.get(k, older.get(k)) == v for k, v in fields.items())), None)


Row = list[str]  # what, measured, ideal, job / DDP's


def _stragglers(configs: list[dict[str, Any]], learners: int, what: str, key: str) -> tuple[str, Optional[Row]]:
    """A row of async against DDP with one ``SLOWDOWN``× straggler that sleeps, and one that busy-waits (holds its
    core, as a slow device would) where the file has it: ``key``, the ideal and the job wall time ratio."""
    found = [_find(configs, learners=learners, slowdown=SLOWDOWN, straggle=how) for how in ("sleep", "busy")]
    if found[0] is None:
        return what, None
    runs = [c["runs"].get("async", {}) for c in found if c is not None]
    never = [key == "tta_vs_ddp" and r.get(key) is None and bool(r.get("tta_s_reps")) for r in runs]
    ratios = ["never" if n else _x(r.get(key)) for r, n in zip(runs, never)]
    measured = f"async {ratios[0]} (sleeping)" + (f", {ratios[1]} (busy-waiting)" if len(runs) > 1 else "")
    ideal = _x(found[0].get("ideal")) + (" (epoch time)" if key == "tta_vs_ddp" else "")
    return what, [what, measured, ideal, ", ".join(_x(r.get("job_vs_ddp")) for r in runs)]


def _epochs(s: dict[str, Any]) -> list[tuple[str, Optional[Row]]]:
    return [
        _stragglers(
            s.get("epochs", []),
            learners,
            f"epoch time, MNIST-1D, {learners} learners, one {SLOWDOWN}× slower",
            "epoch_vs_ddp",
        )
        for learners in (2, 4)
    ]


def _accuracy(s: dict[str, Any]) -> list[tuple[str, Optional[Row]]]:
    configs = s.get("accuracy", [])
    rows = [
        _stragglers(
            configs, learners, f"time to DDP's accuracy, {learners} learners, one {SLOWDOWN}× slower", "tta_vs_ddp"
        )
        for learners in (4, 2)
    ]
    what = "time to DDP's accuracy, no straggler"
    found = {n: _find(configs, learners=n, slowdown=1) for n in (4, 2)}
    runs = {n: c["runs"].get("async", {}) for n, c in found.items() if c is not None}
    if not runs:
        return [*rows, (what, None)]
    ratio = {
        n: "never" if r.get("tta_vs_ddp") is None and r.get("tta_s_reps") else _x(r.get("tta_vs_ddp"))
        for n, r in runs.items()
    }
    measured = ", ".join(f"async {ratio[n]} ({n} learners)" for n in runs)
    return [*rows, (what, [what, measured, "–", ", ".join(_x(r.get("job_vs_ddp")) for r in runs.values())])]


ROUNDS = ("batchsync", "hardsync+backup1", "async+ssp3", "async")  # the protocol family's row, in this order
ROUND_NAMES = {"batchsync": "K-batch-sync", "hardsync+backup1": "backup=1", "async+ssp3": "SSP s=3", "async": "async"}


def _rounds(s: dict[str, Any]) -> list[tuple[str, Optional[Row]]]:
    """Time to DDP's accuracy of the protocol family (results/rounds.json), 4 learners, a sleeping 3× straggler
    and none."""
    rows: list[tuple[str, Optional[Row]]] = []
    for slowdown, what in ((SLOWDOWN, f"one {SLOWDOWN}× slower (sleeping)"), (1, "no straggler")):
        what = f"time to DDP's accuracy, 4 learners, {what}"
        found = _find(s.get("accuracy", []), learners=4, slowdown=slowdown)
        if found is None:
            rows.append((what, None))
            continue
        runs = {k: found["runs"][k] for k in ROUNDS if k in found["runs"]}
        never = {k: r.get("tta_vs_ddp") is None and bool(r.get("tta_s_reps")) for k, r in runs.items()}
        measured = ", ".join(
            f"{ROUND_NAMES[k]} {'never' if never[k] else _x(r.get('tta_vs_ddp'))}" for k, r in runs.items()
        )
        ideal = _x(found.get("ideal")) + " (epoch time)" if slowdown > 1 else "–"
        rows.append((what, [what, measured, ideal, _jobs(runs, tuple(runs))]))
    return rows


def _models(s: dict[str, Any]) -> list[tuple[str, Optional[Row]]]:
    keys = ("hardsync", "async", "hardsync+rpc", "async+rpc")
    what = "10 M MLP, 2 learners, samples/s"
    straggling = f"the same, one {SLOWDOWN}× slower (sleeping)"
    c = _find(s.get("models", []), target_params=10 * M, learners=2)
    if c is None:
        return [(what, None), (straggling, None)]
    rows: list[tuple[str, Optional[Row]]] = [
        (what, [what, _each(c["runs"], keys, "vs_ddp"), "–", _jobs(c["runs"], keys)])
    ]
    if not c.get("straggler") or c.get("slowdown") != SLOWDOWN:
        return rows + [(straggling, None)]
    # the fast learner's rate and a third more; a sleeping straggler frees a core, so a ratio may pass it
    ideal = 1 / stats.ideal_epoch_ratio(c["learners"], c["slowdown"])
    st = c["straggler"]
    return rows + [(straggling, [straggling, _each(st, keys, "vs_ddp"), _x(ideal), _jobs(st, keys)])]


def _network(s: dict[str, Any]) -> list[tuple[str, Optional[Row]]]:
    keys = ("hardsync", "async", "ddp+fp16", "hardsync+bf16", "async+bf16")
    out = []
    for per_host in (1, 2):
        what = f"2 hosts, 1 Gbit/s, 10 M MLP, {per_host} learner{'s' * (per_host > 1)} per host, samples/s"
        c = _find(
            s.get("network", []), rate="1gbit", learners_per_host=per_host, target_params=10 * M, server_node=False
        )
        if c is None:
            out.append((what, None))
            continue
        measured = _each(c["runs"], keys, "vs_ddp", more="vs_ddp_fp16")
        out.append((what, [what, measured, "–", _jobs(c["runs"], keys)]))
    return out


def _network_servers(s: dict[str, Any]) -> list[tuple[str, Optional[Row]]]:
    """The 50 M model across two hosts: one server per host, and four per host with buckets (issue 34)."""
    keys = ("hardsync", "hardsync+buckets+8servers")
    what = "2 hosts, 1 Gbit/s, 50 M MLP, 1 learner per host, samples/s"
    c = _find(s.get("network", []), rate="1gbit", learners_per_host=1, target_params=50 * M, server_node=False)
    if c is None:
        return [(what, None)]
    return [(what, [what, _each(c["runs"], keys, "vs_ddp"), "–", _jobs(c["runs"], keys)])]


def _simulation(s: dict[str, Any]) -> list[tuple[str, Optional[Row]]]:
    sim = s.get("simulation")
    what = "simulated learners in one process, time / one process"
    if sim is None:
        return [(what, None)]
    what = f"λ = {sim['learners']} {what}"
    return [(what, [what, ", ".join(f"{name} {_x(v)}" for name, v in sim["vs_plain"].items()), "–", "–"])]


# results file -> its rows; a row None: its configuration is not in the file
ROWS: list[tuple[str, Callable[[dict[str, Any]], list[tuple[str, Optional[Row]]]]]] = [
    ("epochs", _epochs),
    ("accuracy", _accuracy),
    ("rounds", _rounds),
    ("transport-models", _models),
    ("network", _network),
    ("network-servers-50m", _network_servers),
    ("simulation", _simulation),
]


def _cited(path: str, meta: dict[str, Any]) -> None:
    """Refuses what ``path`` holds if it was measured on modified code or names a commit outside HEAD's history."""
    if meta.get("modified") is not False:  # older files knew only whether lightning_rudra/ was modified
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


def committed(path: str) -> Optional[str]:
    """``path`` as HEAD has it (None: not committed): the README cites committed results, not the working tree's."""
    done = subprocess.run(
        ["git", "show", f"HEAD:{path}"], cwd=provenance.ROOT, capture_output=True, text=True, timeout=30
    )
    return done.stdout if done.returncode == 0 else None


def load(name: str) -> Optional[dict[str, Any]]:
    """A committed results file (None if there is none), refused as :func:`_cited` says."""
    path = f"{provenance.RESULTS}/{name}.json"
    text = committed(path)
    if text is None:
        return None
    result = json.loads(text)
    _cited(path, result.get("meta", {}))
    return result


def study_row() -> tuple[str, Optional[Row], str]:
    """The staleness study's row (``STUDY``: one JSON line per run, each naming its commit): how many stale
    configurations the default rule keeps within the study's target of hardsync, per optimizer, and the worst (a
    run that ended non-finite counts as missed, infinitely far). Only runs of the rate the stale runs trained at
    (the sweeps' other rates left out), each run once (its last row), and only runs of the study's full epochs."""
    from examples.study import staleness as study
    from examples.study.compensation import key
    from examples.study.staleness_report import gaps
    from lightning_rudra.core.compensation import DEFAULT_COMPENSATION

    what = (
        f"3 model families, simulated, default compensation: stale runs within {study.TARGET:g} points (LM "
        f"{study.TARGET:g} %) of hardsync at 1.5× its epochs"
    )
    text = committed(STUDY)
    if text is None:
        return what, None, STUDY
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    for commit, modified in sorted({(r.get("commit"), r.get("modified")) for r in rows}, key=str):
        _cited(STUDY, {"commit": commit, "modified": modified})
    rates: dict[tuple[str, str], set[float]] = {}
    for r in rows:
        if r["protocol"] != "hardsync":
            rates.setdefault((r["family"], r["optimizer"]), set()).add(r["lr"])
    several = {k: sorted(v) for k, v in rates.items() if len(v) > 1}
    if several:
        raise Refused(f"{STUDY} has stale runs at several rates for {several}: one study, one rate per optimizer")
    rows = list({key(r): r for r in rows}.values())  # a run trained again: its last row, as the study reads it
    rows = [
        r
        for r in rows
        if r["lr"] in rates.get((r["family"], r["optimizer"]), ())
        and r.get("epochs") == (study.EPOCHS if r["protocol"] == "hardsync" else study.STALE_EPOCHS)
        and len(r["errors"]) >= r["epochs"]
    ]
    seeds = {k[:3]: v for k, v in gaps(rows, "errors").items() if k[3] == DEFAULT_COMPENSATION}
    if not seeds:
        return what, None, STUDY
    mean = {k: statistics.mean(v) for k, v in seeds.items()}
    mean = {k: v if math.isfinite(v) else math.inf for k, v in mean.items()}
    met = {o: [0, 0] for o in dict.fromkeys(o for _, o, _ in mean)}
    for (_, optimizer, _), gap in mean.items():
        met[optimizer][0] += gap <= study.TARGET
        met[optimizer][1] += 1
    family, optimizer, config = max(mean, key=mean.__getitem__)
    counts = sorted({len(v) for v in seeds.values()})
    cells = (
        f"{sum(m for m, _ in met.values())} of {len(mean)} ("
        + ", ".join(f"{o} {m}/{n}" for o, (m, n) in met.items())
        + f"; worst {family} {optimizer} {config} {mean[family, optimizer, config]:+.1f}; mean of "
        + "–".join(map(str, sorted({counts[0], counts[-1]})))
        + " seeds)"
    )
    # the study's commits are many: its findings.md names each; the row, how many
    trained = sorted({str(r.get("commit"))[:7] for r in rows if r["seed"] in study.SEEDS})
    commits = f"at {len(trained)} commits" if len(trained) > 1 else "".join(trained)
    return what, [what, cells, f"{len(mean)} of {len(mean)}", "–"], commits


def table() -> str:
    """The markdown between the markers: the table, then a note of the rows left out."""
    lines = [
        "| what | measured (against DDP, gloo, unless the row says) | ideal | job wall time / DDP's | results |",
        "| --- | --- | --- | --- | --- |",
    ]
    missing = []
    results = {name: load(name) for name in dict.fromkeys(name for name, _ in ROWS)}
    for name, rows in ROWS:
        result = results[name]
        file = f"{provenance.RESULTS}/{name}"
        if result is None:
            missing += [f"{what} (`{file}.json`)" for what, _ in rows({})]
            continue
        source = f"[{name}]({file}.md) {result['meta']['commit'][:7]}"
        for what, cells in rows(result["summary"]):
            if cells is None:
                missing.append(f"{what} (not in `{file}.json`)")
            else:
                lines.append("| " + " | ".join(cells + [source]) + " |")
    what, cells, commits = study_row()
    if cells is None:
        missing.append(f"{what} (`{STUDY}`)")
    else:
        lines.append("| " + " | ".join(cells + [f"[study](docs/study/staleness/findings.md) {commits}"]) + " |")
    lines += [
        "",
        "Made by `python -m benchmarks.readme`; *ideal*: without overhead; *job wall time*: start-up included, per "
        "strategy in order; each results file names its command.",
    ]
    if missing:
        lines += ["", "Not measured: " + "; ".join(missing) + "."]
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
