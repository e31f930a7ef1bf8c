"""Across hosts at real link speeds (``python -m benchmarks.run --only network``): two hosts on this machine
(``benchmarks.hosts``: network namespaces joined by a veth pair, each host with its own host name, pid namespace and
``/dev/shm``, so that every tensor between the hosts crosses the link), each end of the link shaped by tc's token
bucket (``tbf``) to 1 or 10 Gbit/s. No latency is added: this kernel has no ``netem``.

The MLP of the models phase (10 M parameters, and 50 M with 1 learner per host; a configuration's ``params``),
1 or 2 learners per host, whole epochs: DDP (gloo) against Rudra
hardsync and async with their default options (one server per host, each owning half of the parameters; a
learner reaches its own host's server through shared memory, the other's through RPC), with and without
``compression="bf16"``, alternated as ``Suite._schedule`` orders them. Besides samples/s, the bytes each host's end
of the link sent and received per step, read from its interface's counters inside its namespace: they do not
depend on the CPU the hosts share.

Server nodes (``--network 1gbit:1:2:ddp/hardsync,1gbit:1+s:2:ddp/hardsync+server_node``): λ = 2 in every run of
the ``1+s`` layout, on a pool of 2 workers per host. DDP runs one learner per host as above; a ``+server_node``
strategy runs both learners on host 0 and ``server_nodes=1``, host 1's first worker being the server node (its fit
serves the servers, every server there). Other Rudra strategies go in a configuration of their own (the same λ = 2
with ``1`` learner per host), against that configuration's DDP runs. The bytes per step are read on host 0's end (host 1's
end sends what host 0's receives).
"""

import re
from typing import Any

from benchmarks import stats
from benchmarks.e2e import JOB_TEXT
from benchmarks.config import MODEL_TRAINING, STRATEGIES, TRAINING, TRAINING_PRELOAD
from benchmarks.hosts import two_hosts, why_no_hosts
from benchmarks.pool import Pool
from benchmarks.report import _f, _size_label


COMPRESSED_DDP = "ddp+fp16"  # the baseline of the bf16 rows besides plain DDP


def phase(suite: Any) -> None:
    """The benchmark phase (``suite``: ``benchmarks.suite.Suite``): per link rate and learners per host, two hosts
    and a pool of workers on them, made for its runs and removed after them, also when one fails."""
    cfg = suite.cfg
    why = why_no_hosts(shaped=True)
    if why is not None:
        suite.failures.append(f"network: {why}")
        return
    steps, epochs = cfg["network_steps"], cfg["network_epochs"]
    raw, configs = suite.publish(
        "network",
        (
            f"Two hosts as Linux network namespaces on this machine, each with its own host name, pid namespace and "
            f"`/dev/shm` (so tensors between them cross the link), joined by a veth pair whose ends are shaped by "
            f"`tc qdisc ... tbf` to the rate given (no latency added: this kernel has no netem). The MLP of section 6 "
            f"(its size in the *model* column), μ = {MODEL_TRAINING['batch_size']} per learner, SGD lr "
            f"{TRAINING['lr']} momentum {TRAINING['momentum']}, {steps} steps per learner and epoch, {epochs} epochs, "
            f"no straggler. Rudra with its default options (one server per host, each owning half of the "
            f"parameters, reached through shared memory on its host and through RPC from the other; async with the "
            f"shared epoch, hardsync with DistributedSampler as DDP; with 2 learners per host hardsync aggregates "
            f"on the node: one push per host and round to the other host's server), with `node_aggregation=False` "
            f'(every learner pushes alone), and with `compression="bf16"` (gradients '
            f"pushed through RPC in bfloat16, with error feedback). *samples/s* as in section 6; *vs DDP*: each run "
            f"against the mean of the DDP (gloo) runs just before and after it, median (lowest–highest) over runs. "
            f"*MB per step*: what host 1's end of the link sent / received between two of its first learner's "
            f"batch ends (past warm-up), over the steps taken meanwhile (every learner's batches / λ); median over "
            f"runs; *× model*: the same in units of the model's float32 size. Counted by the interface, so headers "
            f"and control messages are in. *DDP (gloo), fp16_compress_hook*: DDP with its own compression "
            f"(`DDPStrategy(ddp_comm_hook=fp16_compress_hook)`, registered on CPU too, where Lightning would ignore it: "
            f"gradients all-reduced in float16, 2 bytes per parameter as Rudra's bf16; torch refuses its bf16 hook without CUDA and NCCL), beside the bf16 rows; *vs DDP fp16*: a bf16 run against the mean of the "
            f"compressed DDP runs nearest before and after it (they are not scheduled around every run, as plain "
            f"DDP's are), median (lowest–highest). "
            f"{JOB_TEXT}"
        ),
    )
    if any(spec.get("server_node") for spec in cfg["network"]):
        suite.summary["network_info"]["text"] += (
            " Layout 1+s (server nodes): λ = 2, one learner per host, or, for the `server_nodes=1` runs, both on "
            "host 0 and the servers on host 1, a server node (host 1's MB per step then read on host 0's end: what "
            "it received / sent)."
        )
    for spec in cfg["network"]:
        per_host, rate = spec["learners_per_host"], spec["rate"]
        params = spec.get("params", cfg["network_params"])
        learners = 2 * per_host
        batch = spec.get("batch_size", MODEL_TRAINING["batch_size"])
        spare = spec.get("server_node", False)  # the server-node layout: 2 workers per host, λ = 2 (module doc)
        setup = {
            **({"layout": "spare"} if spare else {}),
            **MODEL_TRAINING,
            "batch_size": batch,
            "mlp_params": params,
            "num_learners": learners,
            "num_nodes": 2,
            "num_samples": steps * batch * learners,
            "max_epochs": epochs,
            "profile": True,
        }
        runs: list[dict[str, Any]] = []
        raw.append(
            {"rate": rate, "learners_per_host": per_host, "server_node": spare, "target_params": params, "runs": runs}
        )
        name = f"network-{rate}-{per_host}{'s' if spare else ''}-{params}-{batch}"
        # DDP moved 4 bytes per parameter each way per step in 1.05 s at 1 Gbit/s, 10 M parameters: 3x that
        timeout = 120 + 3 * epochs * steps * 0.3 * params / 1e6 * max(1, batch / 32)
        with two_hosts(rate) as hosts:
            suite.pools[name] = Pool(name, size=4 if spare else learners, preload=TRAINING_PRELOAD, hosts=hosts)
            try:
                suite.pools[name].wait_ready()
                suite.log(f"workers ready: {name}")
                strategies = spec.get("strategies", cfg["network_strategies"])
                for seq, (key, rep) in enumerate(suite._schedule(strategies, spec["reps"])):
                    run = suite._train(key, rep, seq, pool=name, timeout=timeout, sleep_s=[0.0] * learners, **setup)
                    if run is None:
                        continue
                    runs.append(run)
                    link = run.get("link_per_step") or [{}, {}]
                    suite.log(
                        f"network {rate}, {_size_label(params)}, {per_host} per host, rep {rep} {key}: "
                        f"{_f(run.get('samples_per_s'), '{:.0f}')} samples/s, host 1 sent / received "
                        f"{_f(link[1].get('sent', 0) / 1e6, '{:.1f}')} / "
                        f"{_f(link[1].get('received', 0) / 1e6, '{:.1f}')} MB per step "
                        f"(job {run['job_wall_s']:.1f} s)"
                    )
            finally:
                suite.pools.pop(name).close()
        summary = stats.summarize_runs(runs)
        if any(r["strategy"] == COMPRESSED_DDP for r in runs):  # compressed against compressed
            against = stats.summarize_runs(runs, baseline=COMPRESSED_DDP)
            for key in (k for k in summary if "+bf16" in k):
                summary[key].update(vs_ddp_fp16=against[key]["vs_ddp"], vs_ddp_fp16_reps=against[key]["vs_ddp_reps"])
        for key, entry in summary.items():
            computes = [r["compute_s"] for r in runs if r["strategy"] == key and "compute_s" in r]
            entry["compute_s"] = stats.median(computes) if computes else None
            links = [r["link_per_step"] for r in runs if r["strategy"] == key and r.get("link_per_step")]
            entry["link_per_step"] = [
                {way: stats.median([link[host][way] for link in links]) for way in ("sent", "received")}
                for host in range(2)
            ]
        configs.append(
            {
                "rate": rate,
                "learners_per_host": per_host,
                "server_node": spare,
                "batch_size": batch,
                "target_params": params,
                "parameters": runs[0]["parameters"] if runs else params,
                "runs": summary,
            }
        )


def parse_spec(text: str) -> dict[str, Any]:
    """One ``--network`` configuration: RATE:LEARNERS_PER_HOST:REPS[:STRATEGY/STRATEGY...][:PARAMS][:bμ], PARAMS the
    model's size (``50M``, ``500k`` or a number of parameters; the mode's ``network_params`` without it), μ the
    batch per learner (``b256``; 32 without it: more computes longer per byte on the link);
    LEARNERS_PER_HOST ``1+s``: the server-node layout (:func:`phase`)."""
    rate, per_host, reps, *more = text.split(":")
    spare = per_host == "1+s"  # the server-node layout (:func:`phase`)
    spec: dict[str, Any] = {"rate": rate, "learners_per_host": 1 if spare else int(per_host), "reps": int(reps)}
    for field in more:
        batch = re.fullmatch(r"b(\d+)", field)
        if batch:
            spec["batch_size"] = int(batch[1])
            continue
        size = re.fullmatch(r"(\d+(?:\.\d+)?)([kM]?)", field)
        if size:
            spec["params"] = int(float(size[1]) * {"": 1, "k": 1_000, "M": 1_000_000}[size[2]])
            continue
        if "hivemind" in field.split("/"):
            raise ValueError(
                f"--network {text}: hivemind runs in the accuracy phase only (its peers on this host, not the pool's "
                "shaped hosts): --only accuracy --accuracy-strategies async,hivemind"
            )
        unknown = [key for key in field.split("/") if key not in STRATEGIES]
        if unknown:
            raise ValueError(
                f"--network {text}: {', '.join(unknown)} is neither a strategy ({', '.join(STRATEGIES)}) nor a "
                f"number of parameters (50M, 500k, 1000000)"
            )
        spec["strategies"] = field.split("/")
    if spare:
        spec["server_node"] = True
        # a worker's RPC counters count the Rudra stages it took part in, and a stage's processes must agree: host
        # 0's second worker is a learner in the +server_node runs only, so no other Rudra run may share the pool
        other = [
            key for key in spec.get("strategies", ["the default ones"]) if key != "ddp" and "+server_node" not in key
        ]
        if other:
            raise ValueError(
                f"--network {text}: the 1+s layout takes ddp and +server_node strategies only, not {other}; measure "
                "the others in a configuration of their own (RATE:1:REPS:...)"
            )
    return spec
