"""The runtime model (lightning_rudra.core.runtime) against what the benchmarks measured, and its prediction at
a thousand learners.

    python -m benchmarks.predict --validate          # predicted vs measured: results/predict.md and .json
    python -m benchmarks.predict --report --learners 64,256,1000   # 100 M parameters, 10 and 100 Gbit/s
    python -m benchmarks.predict --measure-server    # the server's time per push and update (core/runtime/server_cost.py)

Every input of a validated configuration comes from the results file it is checked against (see docs/prediction.md
for how each is read), plus the server's coefficients measured here.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Optional, Sequence

from lightning_rudra.core.runtime import (
    MEASURED_SERVER,
    Cluster,
    Link,
    Payload,
    Protocol,
    Scenario,
    ServerCost,
    StepTime,
    simulate,
)

RESULTS = os.path.join(os.path.dirname(__file__), "results")
SPEED_TOLERANCE, STALENESS_TOLERANCE = 0.15, 0.20


def measure_server(sizes: Sequence[int] = (100_000, 1_000_000, 4_000_000, 10_000_000), reps: int = 7) -> dict:
    """Medians of ``reps`` pushes into lightning_rudra.core.protocol.Server (2 learners, 1-softsync, momentum SGD,
    one thread): a push that does not close the update, and the extra time of one that does; a line through each."""
    import torch

    from lightning_rudra.core.optimizers import OptimizerSpec
    from lightning_rudra.core.protocol import ProtocolConfig, Server
    from lightning_rudra.core.update import Push

    torch.set_num_threads(1)
    points = []
    for n in sizes:
        w = torch.zeros(n)
        spec = OptimizerSpec.from_optimizer(torch.optim.SGD([w], lr=0.1, momentum=0.5), [w])
        server = Server(ProtocolConfig(2, "softsync", 1), [w], [], [spec])
        pushes, updates = [], []
        for _ in range(reps):
            first, second = (
                Push(r, 0, [torch.randn(n)], torch.tensor([True]), server.clock, [{"lr": 0.1, "momentum": 0.5}], [])
                for r in (0, 1)
            )
            t0 = time.perf_counter()
            server.push(first)
            t1 = time.perf_counter()
            server.push(second)
            t2 = time.perf_counter()
            pushes.append(t1 - t0)
            updates.append(max(0.0, (t2 - t1) - (t1 - t0)))
        points.append({"parameters": n, "push_s": statistics.median(pushes), "update_s": statistics.median(updates)})
    push = _line([p["parameters"] for p in points], [p["push_s"] for p in points])
    update = _line([p["parameters"] for p in points], [p["update_s"] for p in points])
    return {
        "points": points,
        "push": push,
        "update": update,
        "command": "python -m benchmarks.predict --measure-server",
    }


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares y = a x + b, both kept >= 0."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return max(a, 0.0), max(my - a * mx, 0.0)


def _load(name: str) -> dict:
    with open(os.path.join(RESULTS, f"{name}.json")) as f:
        return json.load(f)


class Inputs:
    """What the committed transport results say of this machine's paths: the one-host path through shared memory
    (a learner alone: push+pull minus the server's work), through RPC (the echo of the same bytes) and gloo's
    all-reduce (to take DDP's from its step time, leaving the compute)."""

    def __init__(self, server: ServerCost) -> None:
        raw = _load("transport-models")["raw"]["transport"]
        sizes = sorted(int(n) for n in raw)
        med = {n: {k: statistics.median(v) for k, v in raw[str(n)].items()} for n in sizes}
        self.server = server
        # a push and its reply each move 4N bytes: time = 2 latency + 2 × 32 N / bandwidth
        self.shared = self._path(sizes, [med[n]["solo"] - server.push(n) - server.update(n) for n in sizes])
        self.rpc = self._path(sizes, [med[n]["echo"] for n in sizes])
        self.gloo = _line(sizes, [med[n]["gloo"] for n in sizes])

    @staticmethod
    def _path(sizes: Sequence[int], seconds: Sequence[float]) -> Link:
        slope, intercept = _line(sizes, seconds)
        return Link(64 / slope if slope > 0 else math.inf, intercept / 2)

    def allreduce(self, parameters: int, learners: int) -> float:
        """gloo's all-reduce among λ processes: the 2-process fit × the ring's 2(λ − 1)/λ relative to λ = 2."""
        a, b = self.gloo
        return (a * parameters + b) * (2 * (learners - 1) / learners)

    def compute(self, ddp_step_ms: float, parameters: int, learners: int) -> float:
        return max(ddp_step_ms / 1000 - self.allreduce(parameters, learners), 1e-4)


def _protocol(strategy: str) -> Protocol:
    return Protocol("hardsync" if strategy.startswith("hardsync") else "async")


def _scenario(
    inputs: Inputs, strategy: str, learners: int, lph: int, compute: float, straggle: float, **kw: Any
) -> Scenario:
    """A benchmark's run: the last learner straggles by ``straggle`` seconds a step."""
    times = [StepTime(compute)] * learners
    if straggle:
        times = times[:-1] + [StepTime(compute + straggle)]
    local = inputs.rpc if "rpc" in strategy else inputs.shared
    servers = 2 if "2servers" in strategy else max(1, learners // lph if lph < learners else 1)
    cluster = Cluster(
        hosts=learners // lph,
        learners_per_host=lph,
        link=kw.pop("link", Link()),
        local=local,
        num_servers=kw.pop("servers", servers),
        node_aggregation="no_aggregation" not in strategy,
    )
    payload = Payload(kw.pop("parameters"), "bf16" if "bf16" in strategy else "none")
    return Scenario(_protocol(strategy), cluster, times, payload, inputs.server, **kw)


def validation_rows(inputs: Inputs) -> list[dict]:
    rows: list[dict] = []

    def add(source: str, config: str, strategy: str, measured: dict, scenario: Scenario) -> None:
        p = simulate(scenario)
        ratio = p.samples_per_s / measured["samples_per_s"]
        row = {
            "source": source,
            "config": config,
            "strategy": strategy,
            "measured_samples_per_s": measured["samples_per_s"],
            "predicted_samples_per_s": p.samples_per_s,
            "ratio": ratio,
            "measured_staleness": measured.get("mean_staleness"),
            "predicted_staleness": p.mean_staleness,
            "prediction": p.to_dict(),
        }
        ms = measured.get("mean_staleness")
        row["staleness_ok"] = (
            None if ms is None else (abs(p.mean_staleness - ms) <= STALENESS_TOLERANCE * max(ms, 1e-9))
        )
        row["speed_ok"] = abs(ratio - 1) <= SPEED_TOLERANCE
        rows.append(row)

    # section 5 and 7: MNIST-1D, one host, the last learner sleeps or busy-waits (k - 1) t a step
    for name, key, samples, epochs_key in (
        ("epochs", "epochs", 6000, "epochs_per_run"),
        ("accuracy", "accuracy", 6000, "accuracy_epochs"),
    ):
        data = _load(name)
        epochs = data["meta"]["config"][epochs_key]
        calibration = {r["learners"]: r["calibration"] for r in data["raw"][key]}
        for row in data["summary"][key]:
            lam, mu = row["learners"], row["batch_size"]
            compute = inputs.compute(calibration[lam]["step_ms"], calibration[lam]["parameters"], lam)
            straggle = (row["sleep_ms"] / 1000) if row.get("slowdown", 1) > 1 else 0.0
            batches = int(samples * 0.72) // mu
            config = f"λ={lam} μ={mu}, " + (f"{row['slowdown']}x {row['straggle']}" if straggle else "no straggler")
            for strategy, measured in row["runs"].items():
                if strategy == "ddp":
                    continue
                sc = _scenario(
                    inputs,
                    strategy,
                    lam,
                    lam,
                    compute,
                    straggle,
                    parameters=calibration[lam]["parameters"],
                    batch_size=mu,
                    batches=batches,
                    epochs=epochs,
                    servers=1,
                )
                add(name, config, strategy, measured, sc)
    # section 6: MLPs of 10 M and 50 M parameters, one host
    data = _load("transport-models")
    ddp_compute = {}
    for row in data["summary"]["models"]:
        lam, n = row["learners"], row["parameters"]
        mu, batches = row["batch_size"], row["samples"] // row["batch_size"]
        compute = inputs.compute(row["runs"]["ddp"]["step_ms"], n, lam)
        ddp_compute[(lam, row["target_params"])] = compute
        for label, runs, straggle in (
            ("no straggler", row["runs"], 0.0),
            ("3x sleep", row.get("straggler", {}), row.get("sleep_ms", 0) / 1000),
        ):
            for strategy, measured in runs.items():
                if strategy == "ddp":
                    continue
                sc = _scenario(
                    inputs,
                    strategy,
                    lam,
                    lam,
                    compute,
                    straggle,
                    parameters=n,
                    batch_size=mu,
                    batches=batches,
                    epochs=row["epochs"],
                    servers=2 if "2servers" in strategy else 1,
                )
                add("transport-models", f"MLP {n / 1e6:.0f} M, λ={lam}, {label}", strategy, measured, sc)
    # section 8: two hosts joined by a shaped link, one server per host
    data = _load("network")
    cfg = data["meta"]["config"]
    for row in data["summary"]["network"]:
        lph, n, mu = row["learners_per_host"], row["parameters"], row["batch_size"]
        lam = 2 * lph
        rate = float(row["rate"].replace("gbit", "")) * 1e9
        compute = ddp_compute[(lam, row["target_params"])]
        for strategy, measured in row["runs"].items():
            if strategy.startswith("ddp"):
                continue
            sc = _scenario(
                inputs,
                strategy,
                lam,
                lph,
                compute,
                0.0,
                parameters=n,
                batch_size=mu,
                batches=cfg["network_steps"] * lam,
                epochs=cfg["network_epochs"],
                link=Link(rate),
                servers=2,
            )
            add("network", f"2 hosts × {lph}, {row['rate']}, 10 M", strategy, measured, sc)
    return rows


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


def _fmt(x: Optional[float], digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def validation_markdown(rows: list[dict], server: dict) -> str:
    speed = sum(r["speed_ok"] for r in rows)
    stale = [r for r in rows if r["staleness_ok"] is not None]
    lines = [
        "# The runtime model against the benchmarks",
        "",
        "`python -m benchmarks.predict --validate`: every Rudra configuration of results/epochs, accuracy, "
        "transport-models and network, its inputs read from the same file (docs/prediction.md says how), the "
        f"server's coefficients measured by `{server['command']}`. Targets: samples/s within "
        f"{SPEED_TOLERANCE:.0%}, mean σ within {STALENESS_TOLERANCE:.0%}. Met: samples/s {speed} of {len(rows)}, "
        f"mean σ {sum(r['staleness_ok'] for r in stale)} of {len(stale)} (where measured).",
        "",
        "| results file | configuration | strategy | measured samples/s | predicted | predicted / measured | "
        "measured mean σ | predicted mean σ |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mark = "" if r["speed_ok"] else " ✗"
        smark = "" if r["staleness_ok"] in (None, True) else " ✗"
        lines.append(
            f"| {r['source']} | {r['config']} | {r['strategy']} | {r['measured_samples_per_s']:.0f} | "
            f"{r['predicted_samples_per_s']:.0f} | {r['ratio']:.2f}{mark} | {_fmt(r['measured_staleness'])} | "
            f"{r['predicted_staleness']:.2f}{smark} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.predict", description=__doc__.split("\n")[0])
    parser.add_argument("--validate", action="store_true", help="predicted vs measured: results/predict.md, .json")
    parser.add_argument("--report", action="store_true", help="the prediction at scale (Markdown to stdout)")
    parser.add_argument("--learners", default="64,256,1000", help="λ list of the report")
    parser.add_argument("--measure-server", action="store_true", help="measure the server's time per push, update")
    parser.add_argument("--out", default=RESULTS, help="where predict.md and predict.json go")
    args = parser.parse_args(argv)
    if not (args.validate or args.report or args.measure_server):
        parser.error("give --validate, --report or --measure-server")
    server = {"command": "python -m benchmarks.predict --measure-server", "coefficients": vars(MEASURED_SERVER)}
    if args.measure_server:
        measured = measure_server()
        print(json.dumps(measured, indent=1))
    out: dict[str, Any] = {"server": server}
    text = ""
    if args.validate:
        rows = validation_rows(Inputs(MEASURED_SERVER))
        out["validation"] = rows
        text += validation_markdown(rows, server)
    if args.report:
        learners = [int(x) for x in args.learners.split(",")]
        md, rows = report(learners)
        out["report"] = rows
        text += ("\n" if text else "") + md
    if text:
        print(text)
    if args.validate:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "predict.json"), "w") as f:
            json.dump(out, f, indent=1, default=str)
        with open(os.path.join(args.out, "predict.md"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
