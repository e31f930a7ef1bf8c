"""The runtime model against what the benchmarks measured: every Rudra row of results/epochs, accuracy,
transport-models and network, its inputs read from the same files (:class:`~benchmarks.predict.inputs.Inputs`)."""

from dataclasses import replace
from typing import Any, Optional

from benchmarks.predict.inputs import Inputs, _load
from lightning_rudra.core.runtime import MEASURED_BF16, Cluster, Link, Payload, Protocol, Scenario, StepTime, simulate

SPEED_TOLERANCE, STALENESS_TOLERANCE = 0.15, 0.20


def _protocol(strategy: str) -> Protocol:
    return Protocol("hardsync" if strategy.startswith("hardsync") else "async")


def _scenario(
    inputs: Inputs,
    strategy: str,
    learners: int,
    lph: int,
    compute: float,
    straggle: float = 0.0,
    how: Optional[str] = "sleep",
    **kw: Any,
) -> Scenario:
    """A benchmark's run on this machine's cores: the last learner straggles by ``straggle`` seconds a step,
    asleep or busy-waiting (``how``). Two hosts are network namespaces of this one machine."""
    jitter = inputs.jitter_of(kw.pop("source"))
    step = StepTime(compute, "lognormal", jitter) if jitter else StepTime(compute)
    times = [step] * learners
    if straggle:
        wait = {"spin": straggle} if how == "busy" else {"sleep": straggle}
        times = times[:-1] + [StepTime(step.mean, step.kind, step.spread, **wait)]
    rpc = "rpc" in strategy
    hosts = learners // lph
    server = inputs.server
    if rpc:
        # one host through RPC: the echo measured at this size (not the line through every size), and the copies
        # RPC's path makes beside the wire (inputs.py): the learner packs its gradient into a new tensor and loads
        # the reply's weights (CPU time added to its step), the server clones its weights for every reply it makes
        # (SharedSide.reply: one a push, answered at once, but one a hardsync round, its replies sharing it)
        n = kw["parameters"]
        local = inputs.rpc_at(n)
        extra = inputs.rpc_cost(n, "pack") + inputs.rpc_cost(n, "load")
        times = [replace(t, mean=t.mean + extra * t.mean / compute) for t in times]
        clone = inputs.rpc_cost(n, "clone") / n
        per = "update_per_parameter" if strategy.startswith("hardsync") else "push_per_parameter"
        server = replace(server, **{per: getattr(server, per) + clone})
    else:
        local = inputs.shared
    cluster = Cluster(
        hosts=hosts,
        learners_per_host=lph,
        link=kw.pop("link", Link()).with_transport(inputs.rpc),  # between hosts: RPC over the wire
        local=local,
        num_servers=kw.pop("servers"),
        node_aggregation="no_aggregation" not in strategy,
        cores=inputs.cores,
        one_machine=True,
        shared_memory=not rpc,
    )
    bf16 = "bf16" in strategy
    codec = dict(zip(("learner_codec", "server_codec"), MEASURED_BF16)) if bf16 else {}
    payload = Payload(kw.pop("parameters"), "bf16" if bf16 else "none", **codec)
    return Scenario(_protocol(strategy), cluster, times, payload, server, **kw)


COMPUTE_SOURCES = ("ddp", "alone")


def validation_rows(inputs: Inputs, compute_from: str = "ddp") -> list[dict]:
    """Every configuration's prediction against its measurement. ``compute_from``: each learner's compute taken
    from the DDP runs beside it (``ddp``: :meth:`Inputs.compute`) or as measured alone (``alone``:
    :meth:`Inputs.alone`, ``--measure-compute``'s table)."""
    rows: list[dict] = []
    alone = compute_from == "alone"

    def add(source: str, config: str, strategy: str, measured: dict, scenario: Scenario) -> None:
        p = simulate(scenario)
        ratio = p.samples_per_s / measured["samples_per_s"]
        ms = measured.get("mean_staleness")
        row = {
            "source": source,
            "config": config,
            "strategy": strategy,
            "measured_samples_per_s": measured["samples_per_s"],
            "predicted_samples_per_s": p.samples_per_s,
            "ratio": ratio,
            "measured_staleness": ms,
            "predicted_staleness": p.mean_run_staleness,
            "prediction": p.to_dict(),
            "speed_ok": abs(ratio - 1) <= SPEED_TOLERANCE,
            "staleness_ok": None
            if ms is None
            else abs(p.mean_run_staleness - ms) <= STALENESS_TOLERANCE * max(ms, 1e-9),
        }
        rows.append(row)

    # section 5 and 7: MNIST-1D, one host, the last learner sleeps or busy-waits (k - 1) t a step; the compute from
    # the DDP runs of the same row (alternated with the Rudra runs, minutes apart at most), or measured alone
    for name, key, epochs_key in (("epochs", "epochs", "epochs_per_run"), ("accuracy", "accuracy", "accuracy_epochs")):
        data = _load(name)
        epochs = data["meta"]["config"][epochs_key]
        parameters = {r["learners"]: r["calibration"]["parameters"] for r in data["raw"][key]}
        for row in data["summary"][key]:
            lam, mu = row["learners"], row["batch_size"]
            straggle = (row["sleep_ms"] / 1000) if row.get("slowdown", 1) > 1 else 0.0
            compute = (
                inputs.alone("mnist1d", mu)
                if alone
                else inputs.compute(row["runs"]["ddp"]["step_ms"], parameters[lam], lam, straggle)
            )
            batches = int(6000 * 0.72) // mu
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
                    row.get("straggle"),
                    parameters=parameters[lam],
                    batch_size=mu,
                    batches=batches,
                    epochs=epochs,
                    servers=1,
                    source=name,
                )
                add(name, config, strategy, measured, sc)
    # section 6: MLPs of 10 M and 50 M parameters, one host; the compute from each table's DDP row
    data = _load("transport-models")
    ddp_compute = {}
    for row in data["summary"]["models"]:
        lam, n = row["learners"], row["parameters"]
        mu, batches = row["batch_size"], row["samples"] // row["batch_size"]
        model = f"mlp{row['target_params'] // 1_000_000}M"
        compute = inputs.alone(model, mu) if alone else inputs.compute(row["runs"]["ddp"]["step_ms"], n, lam)
        ddp_compute[(lam, row["target_params"])] = compute
        for label, runs, straggle in (
            ("no straggler", row["runs"], 0.0),
            ("3x sleep", row.get("straggler", {}), row.get("sleep_ms", 0) / 1000),
        ):
            if straggle and runs.get("ddp", {}).get("step_ms") and not alone:
                compute = inputs.compute(runs["ddp"]["step_ms"], n, lam, straggle)
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
                    source="transport-models",
                )
                add("transport-models", f"MLP {n / 1e6:.0f} M, λ={lam}, {label}", strategy, measured, sc)
    # section 8: two hosts (namespaces of this machine) joined by a shaped link, one server per host
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
                parameters=n,
                batch_size=mu,
                batches=cfg["network_steps"] * lam,
                epochs=cfg["network_epochs"],
                link=Link(rate),
                servers=2,
                source="network",
            )
            add("network", f"2 hosts × {lph}, {row['rate']}, 10 M", strategy, measured, sc)
    return rows


def _fmt(x: Optional[float], digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def validation_markdown(rows: list[dict], server: dict, compute: str) -> str:
    speed = sum(r["speed_ok"] for r in rows)
    stale = [r for r in rows if r["staleness_ok"] is not None]
    lines = [
        "# The runtime model against the benchmarks",
        "",
        "`python -m benchmarks.predict --validate`: every Rudra configuration of results/epochs, accuracy, "
        "transport-models and network, its inputs read from the same file (docs/prediction.md says how), the "
        f"server's coefficients measured by `{server['command']}`, each learner's compute {compute}. Targets: samples/s within "
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
