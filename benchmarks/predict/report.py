"""The prediction that no one here can measure: λ = 64 … 1,000 learners, a 100 M-parameter model."""

import statistics
from typing import Optional, Sequence

from lightning_rudra.core.runtime import MEASURED_SERVER, Cluster, Link, Payload, Protocol, Scenario, StepTime, simulate


def report_protocols(learners: int) -> list[Protocol]:
    """Every protocol at λ: hardsync, with 5 % backup learners, K-batch-sync (K = λ), 1-softsync, 4-softsync,
    async, and async under SSP with s = 2λ (blocking only the far outliers)."""
    return [
        Protocol("hardsync"),
        Protocol("hardsync", backup=max(1, learners // 20)),
        Protocol("batchsync"),
        Protocol("softsync", n=1),
        Protocol("softsync", n=4),
        Protocol("async"),
        Protocol("async", max_staleness=2 * learners),
    ]


REPORT_STEP = StepTime(0.25, "lognormal", 0.2)  # a 100 M model's forward and backward on one accelerator, jittered
REPORT_PARAMETERS = 100_000_000


def report_one(protocol: Protocol, learners: int, gbit: float, steps: int = 8, max_servers: int = 4096) -> dict:
    """Sweep num_servers (doubling) until samples/s improves by 5 % or less; the fewest servers that reach that."""
    best: Optional[dict] = None
    servers = 1
    while servers <= max_servers:
        cluster = Cluster(learners, 1, Link.gbit(gbit, 5e-6), num_servers=servers, servers_on="own_hosts")
        scenario = Scenario(
            protocol,
            cluster,
            REPORT_STEP,
            Payload(REPORT_PARAMETERS),
            MEASURED_SERVER,
            batch_size=32,
            batches=steps * learners,
            warmup=2,
            seed=1,
        )
        p = simulate(scenario)
        row = {"servers": servers, **p.to_dict()}
        if best is not None and row["samples_per_s"] <= best["samples_per_s"] * 1.05:
            break
        best = row
        servers *= 2
    assert best is not None
    return best


def report(learners: Sequence[int], links: Sequence[float] = (10, 100)) -> tuple[str, list[dict]]:
    ideal = {lam: 32 * lam / REPORT_STEP.mean for lam in learners}
    rows = []
    for lam in learners:
        for gbit in links:
            for protocol in report_protocols(lam):
                rows.append(
                    {"learners": lam, "gbit": gbit, "protocol": str(protocol), **report_one(protocol, lam, gbit)}
                )
    lines = [
        f"# Predicted at scale: {REPORT_PARAMETERS / 1e6:.0f} M parameters (float32), one learner per host",
        "",
        f"`python -m benchmarks.predict --report --learners {','.join(map(str, learners))}`. Each learner's compute: "
        f"log-normal, mean {REPORT_STEP.mean} s, σ(log) {REPORT_STEP.spread}; μ = 32. Servers on hosts of their own, "
        "every host's link as given (5 µs latency), the server's time per push and update as measured on this "
        "project's 2-core CPU (one thread; core/runtime/server_cost.py). *servers*: the fewest (doubling) past "
        "which samples/s improves by 5 % or less. *ideal*: λ μ / compute, no link and no server.",
        "",
        "| λ | link | protocol | servers | samples/s | of ideal | mean σ | wasted | server busy | epoch s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        busy = statistics.fmean(r["server_utilisation"]) if r["server_utilisation"] else 0.0
        lines.append(
            f"| {r['learners']} | {r['gbit']:g} Gbit/s | {r['protocol']} | {r['servers']} | {r['samples_per_s']:.0f} | "
            f"{r['samples_per_s'] / ideal[r['learners']]:.2f} | {r['mean_staleness']:.1f} | {r['wasted']:.2f} | "
            f"{busy:.2f} | {r['epoch_s']:.2f} |"
        )
    return "\n".join(lines) + "\n", rows
