"""1-softsync (the default protocol until this study) against async (the default after it), simulated learners, the
staleness study's harness and rates, the default compensation, 30 epochs, seeds 0-2. ``--train`` trains the
1-softsync runs of clipped SGD, Adam and AdamW (about 14 minutes on 2 cores) into ``runs.jsonl``; momentum SGD's
are the unpatched runs of ``../softsync-cap``. Without it, prints the gap of each to the study's hardsync runs."""

import json
import statistics
import sys
from multiprocessing import get_context
from pathlib import Path

HERE = Path(__file__).parent
STUDY = HERE.parents[1] / "runs.jsonl"  # the staleness study's: hardsync's and async's runs
SGD = HERE.parent / "softsync-cap" / "runs.jsonl"  # 1-softsync with momentum SGD, "as it is"
RULE = "momentum+clip+syncnorm+dana"
FAMILIES, OPTIMIZERS, LEARNERS, SEEDS = ("cnn", "mlp", "lm"), ("sgd", "sgd-clip", "adam", "adamw"), (4, 16), (0, 1, 2)


def rows(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def rates() -> dict:
    """The rate the study's stale runs of each family and optimizer trained at (hardsync's, swept)."""
    return {(r["family"], r["optimizer"]): r["lr"] for r in rows(STUDY) if r["rule"] == RULE}


def one(args):
    family, optimizer, learners, seed, lr = args
    import torch

    from examples.study.compensation import train

    torch.set_num_threads(1)
    out = train(optimizer, "softsync", learners, 1, RULE, seed, 30, lr, family=family)
    return dict(family=family, optimizer=optimizer, learners=learners, seed=seed, errors=out["errors"])


def gap(family, stale, hard):
    return 100 * (stale / hard - 1) if family == "lm" else 100 * (stale - hard)


def report() -> None:
    study, lr = rows(STUDY), rates()
    softsync = rows(HERE / "runs.jsonl") + [
        dict(r, optimizer="sgd") for r in rows(SGD) if not r["patched"] and r["n"] == 1
    ]
    synchronous = [
        r
        for r in study
        if r["protocol"] == "hardsync" and r["epochs"] == 20 and r["lr"] == lr.get((r["family"], r["optimizer"]))
    ]
    hard = {(r["family"], r["optimizer"], r["seed"]): r["errors"][-1] for r in synchronous}
    assert len(hard) == len(synchronous), "one hardsync run per family, optimizer and seed"
    asynchronous = [r for r in study if r["protocol"] == "async" and r["rule"] == RULE and r["epochs"] == 30]
    print("| family | optimizer | λ | 1-softsync | async |\n|---|---|---|---|---|")
    gaps = []  # per cell: ((1-softsync after 30, after 20), (async after 30, after 20))
    for f in FAMILIES:
        for o in OPTIMIZERS:
            for lam in LEARNERS:

                def cell(runs):
                    picked = [r for r in runs if (r["family"], r["optimizer"], r["learners"]) == (f, o, lam)]
                    picked = [r for r in picked if r["seed"] in SEEDS and r.get("lr", lr[f, o]) == lr[f, o]]
                    assert sorted(r["seed"] for r in picked) == list(SEEDS), (f, o, lam)
                    return [
                        statistics.mean(gap(f, r["errors"][e], hard[f, o, r["seed"]]) for r in picked) for e in (-1, 19)
                    ]

                gaps.append((cell(softsync), cell(asynchronous)))
                print(f"| {f} | {o} | {lam} | " + " | ".join("{:+.1f} ({:+.1f})".format(*g) for g in gaps[-1]) + " |")
    for e, after in ((0, 30), (1, 20)):
        met = [sum(g[p][e] <= 2 for g in gaps) for p in (0, 1)]
        lower = sum(g[1][e] < g[0][e] for g in gaps)
        print(
            f"after {after} epochs: within 2: 1-softsync {met[0]}, async {met[1]} of {len(gaps)}; async lower in {lower}"
        )


if __name__ == "__main__":
    if "--train" in sys.argv:
        lr = rates()
        jobs = [(f, o, n, s, lr[f, o]) for f in FAMILIES for o in OPTIMIZERS[1:] for n in LEARNERS for s in SEEDS]
        with get_context("spawn").Pool(2, maxtasksperchild=1) as pool:
            (HERE / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pool.map(one, jobs, chunksize=1)))
    report()
