"""Prototype (not the package): 1-softsync's per-update cap under the default compensation, as is and with the cap
binding only above the staleness expected for c (Rudra's <σ> ≈ n = λ/c). Simulated learners, the staleness study's
train(), momentum SGD at the study's rates; gap to the study's hardsync runs (same seed) after 30 and 20 epochs."""

import json
import statistics
import sys
from multiprocessing import get_context
from pathlib import Path

HERE = Path(__file__).parent
STUDY = HERE.parents[1] / "runs.jsonl"  # the staleness study's runs: hardsync's

RATES = {"cnn": 0.2, "mlp": 0.2, "lm": 0.8}
RULE = "momentum+clip+syncnorm+dana"


def one(args):
    family, learners, n, seed, patched = args
    import torch
    import lightning_rudra.core.updating as updating
    from lightning_rudra.core import compensation
    from examples.study.compensation import train

    torch.set_num_threads(1)
    original = compensation.momentum_hyperparameters

    def capped_above_expected(group, optimizer, c, lam, mean_sigma, update_sigma, dana=False):
        if c > 1:
            expected = lam / c  # n
            update_sigma = (update_sigma + 1) * expected / (expected + 1) - 1
        return original(group, optimizer, c, lam, mean_sigma, update_sigma, dana)

    if patched:
        updating.momentum_hyperparameters = capped_above_expected
    out = train("sgd", "softsync", learners, n, RULE, seed, 30, RATES[family], family=family)
    return dict(
        family=family,
        learners=learners,
        n=n,
        seed=seed,
        patched=patched,
        errors=out["errors"],
        mean_staleness=out.get("mean_staleness"),
    )


if __name__ == "__main__":
    families = sys.argv[1].split(",") if len(sys.argv) > 1 else ["cnn", "mlp", "lm"]
    configs = [(4, 1), (16, 1), (16, 4)]
    jobs = [(f, lam, n, s, p) for f in families for (lam, n) in configs for s in (0, 1, 2) for p in (False, True)]
    # a fresh process per run: the patch must not outlive its run
    with get_context("spawn").Pool(2, maxtasksperchild=1) as pool:
        rows = pool.map(one, jobs, chunksize=1)
    (HERE / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    study = [json.loads(line) for line in STUDY.read_text().splitlines()]
    sync = {
        (r["family"], r["seed"]): r["errors"]
        for r in study
        if r["protocol"] == "hardsync"
        and r["optimizer"] == "sgd"
        and r["lr"] == RATES[r["family"]]
        and r["epochs"] == 20
    }

    def gap(fam, stale, hard):
        return 100 * (stale / hard - 1) if fam == "lm" else 100 * (stale - hard)

    for f in families:
        for lam, n in configs:
            for p in (False, True):
                rs = [
                    r for r in rows if r["family"] == f and r["learners"] == lam and r["n"] == n and r["patched"] == p
                ]
                g30 = [gap(f, r["errors"][-1], sync[f, r["seed"]][-1]) for r in rs]
                g20 = [gap(f, r["errors"][19], sync[f, r["seed"]][-1]) for r in rs]
                print(
                    f"{f} λ={lam} {n}-softsync {'patched' if p else 'as is  '}: gap@30 {statistics.mean(g30):+.1f} "
                    f"gap@20 {statistics.mean(g20):+.1f}  σ {statistics.mean(r['mean_staleness'] or 0 for r in rs):.2f}"
                )
