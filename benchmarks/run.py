"""lightning_rudra benchmark suite: one command, a table on stdout, the numbers as JSON.

    python -m benchmarks.run [--quick] [--out benchmarks/results]

1. Transport: a push+pull round trip through the real server (async) for 10 k, 1 M, 10 M and 50 M float32, against
   a gloo all-reduce of the same buffer between the same 2 processes and a memcpy; TensorPipe settings for a
   bare RPC round trip; prototype fixes for the push path.
2. End to end, no straggler: samples/s of the MNIST-1D example module under every Rudra protocol and DDP.
3. One learner 3x slower: async and 2-softsync against DDP.
4. Time to a fixed test accuracy on MNIST-1D, from the same runs as 2.
5. Epochs with one straggler (3x, 8x slower), 2 and 4 learners: time per epoch and time to accuracy of async
   (the shared epoch) against DDP.
6. Real model sizes: MLPs of 10 M and 50 M parameters on synthetic data, 2 and 4 learners: samples/s over whole
   epochs of hardsync, async and async without shared memory against DDP, and of async with one 3x straggler.
7. Time to DDP's accuracy (``benchmarks.accuracy``): momentum SGD at DDP's rate, 2 and 4 learners, one 3x
   straggler and none: the time async with its default options takes to reach DDP's final test accuracy.
8. Across hosts (``benchmarks.network``, needs root): two hosts as network namespaces, the link shaped to 1 and
   10 Gbit/s, the 10 M MLP with 1 and 2 learners per host: samples/s and bytes on the link per step of DDP, Rudra
   hardsync and async, with and without compressed pushes.

Everything runs in long-lived worker processes (``benchmarks.pool``) so that process start-up is paid once;
each comparison is measured in the same run, repeated, and reported as the median of per-round ratios.
See ``benchmarks/README.md``.
"""

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import socket
import sys
import time
import traceback
from typing import Any, Optional

from benchmarks import accuracy, network, report
from benchmarks.pool import JobFailed, Pool

M = 1_000_000

VARIANTS = [  # TensorPipe settings for a bare round trip; the first is the one lightning_rudra pins
    {"label": "uv (lightning_rudra)", "transports": ["uv"], "channels": None},
    {"label": "uv + basic", "transports": ["uv"], "channels": ["basic"]},
    {"label": "uv + cma", "transports": ["uv"], "channels": ["cma"]},
    {"label": "uv + mpt_uv", "transports": ["uv"], "channels": ["mpt_uv"]},
    {"label": "shm", "transports": ["shm"], "channels": None},
    {"label": "shm + basic", "transports": ["shm"], "channels": ["basic"]},
    {"label": "torch default", "transports": None, "channels": None},
]

THP = {"THP_MEM_ALLOC_ENABLE": "1"}
PROTOTYPES = [  # label, pool, server patches, server-only environment, learner patches
    ("package as is", "main", [], {}, []),
    ("THP on the server", "main", [], THP, []),
    ("pack into reused buffers", "main", [], {}, ["pack_reuse"]),
    ("THP everywhere", "thp", [], {}, []),
]

STRATEGIES = {  # key -> (strategy, n, prototype changes, more RudraStrategy options)
    "ddp": ("ddp", 1, [], {}),
    "hardsync": ("hardsync", 1, [], {}),
    "softsync1": ("softsync", 1, [], {}),
    "softsync2": ("softsync", 2, [], {}),
    "async": ("async", 1, [], {}),
    "async+overlap": ("async", 1, [], {"overlap": True}),
    "async+rpc": ("async", 1, [], {"shared_memory": False}),
    "hardsync+2servers": ("hardsync", 1, [], {"num_servers": 2}),
    "async+2servers": ("async", 1, [], {"num_servers": 2}),
    "async+quiet_log": ("async", 1, ["quiet_log"], {}),
    "async+overlap+quiet_log": ("async", 1, ["quiet_log"], {"overlap": True}),
    "hardsync+quiet_log": ("hardsync", 1, ["quiet_log"], {}),
    "hardsync+bf16": ("hardsync", 1, [], {"compression": "bf16"}),
    "async+bf16": ("async", 1, [], {"compression": "bf16"}),
    "hardsync+no_aggregation": ("hardsync", 1, [], {"node_aggregation": False}),
    # the network phase's "1+s" layout: both learners on host 0, the servers on host 1, a server node
    "hardsync+server_node": ("hardsync", 1, [], {"server_nodes": 1}),
    "async+server_node": ("async", 1, [], {"server_nodes": 1}),
}
report.STRATEGY_LABELS.update(
    {
        "async+overlap": "Rudra async, overlap=True",
        "async+rpc": "Rudra async, shared_memory=False (all through RPC)",
        "hardsync+2servers": "Rudra hardsync, num_servers=2",
        "async+2servers": "Rudra async, num_servers=2",
        "async+quiet_log": "Rudra async, staleness logged every 50 steps (prototype)",
        "async+overlap+quiet_log": "Rudra async, overlap=True, staleness logged every 50 steps (prototype)",
        "hardsync+quiet_log": "Rudra hardsync, staleness logged every 50 steps (prototype)",
        "hardsync+bf16": 'Rudra hardsync, compression="bf16"',
        "async+bf16": 'Rudra async, compression="bf16"',
        "hardsync+no_aggregation": "Rudra hardsync, node_aggregation=False",
        "hardsync+server_node": "Rudra hardsync, 2 learners on host 0, server_nodes=1 (host 1)",
        "async+server_node": "Rudra async, 2 learners on host 0, server_nodes=1 (host 1)",
    }
)

DEFAULT = {
    "sizes": [10_000, 1 * M, 10 * M, 50 * M],
    "transport_rounds": 3,
    "transport_servers": [2],
    "variant_sizes": [10_000, 1 * M, 10 * M, 50 * M],
    "variant_rounds": 2,
    "variants": [v["label"] for v in VARIANTS],
    "prototype_rounds": 2,
    "prototypes": [p[0] for p in PROTOTYPES],
    "e2e_reps": 3,
    "e2e_steps": 600,
    "target_accuracy": 0.6,
    "snapshot_every": 5,
    "ddp_every": 3,
    "e2e_strategies": [
        "ddp",
        "hardsync",
        "softsync1",
        "softsync2",
        "async",
        "async+overlap",
        "async+overlap+quiet_log",
    ],
    "straggler_reps": 3,
    "straggler_window_s": 2.5,
    "straggler_strategies": ["ddp", "async", "softsync2", "async+overlap"],
    "epoch_learners": [2, 4],
    "epoch_slowdowns": [3, 8],
    "epochs_per_run": 4,
    "epoch_reps": 2,
    "epoch_samples": 6000,
    "epoch_calibration_steps": 80,
    "epoch_target_accuracy": 0.4,
    "models": [
        {"params": 10 * M, "learners": 2, "samples": 384, "epochs": 4, "reps": 3},
        {"params": 50 * M, "learners": 2, "samples": 192, "epochs": 3, "reps": 1},
        {"params": 10 * M, "learners": 4, "samples": 768, "epochs": 3, "reps": 1},
    ],
    "accuracy_learners": [2, 4],
    "accuracy_slowdowns": [3, 1],
    "accuracy_epochs": 10,
    "accuracy_reps": 2,
    "accuracy_samples": 6000,
    "network": [
        {"rate": "1gbit", "learners_per_host": 1, "reps": 2},
        # hardsync there aggregates on the node by default: against the same without it
        {
            "rate": "1gbit",
            "learners_per_host": 2,
            "reps": 2,
            "strategies": ["ddp", "hardsync", "hardsync+no_aggregation", "async", "hardsync+bf16", "async+bf16"],
        },
        {"rate": "10gbit", "learners_per_host": 1, "reps": 1},
    ],
    "network_params": 10 * M,
    "network_steps": 6,
    "network_epochs": 3,
    "network_strategies": ["ddp", "hardsync", "async", "hardsync+bf16", "async+bf16"],
}
QUICK = {
    "sizes": [10 * M],
    "transport_rounds": 2,
    "transport_servers": [2],
    "variant_sizes": [10_000, 10 * M],
    "variant_rounds": 1,
    "variants": ["uv (lightning_rudra)", "uv + basic", "shm", "torch default"],
    "prototype_rounds": 1,
    "prototypes": ["package as is", "pack into reused buffers"],
    "e2e_reps": 2,
    "e2e_steps": 250,
    "target_accuracy": 0.4,
    "snapshot_every": 5,
    "ddp_every": 3,
    "e2e_strategies": ["ddp", "hardsync", "softsync1", "softsync2", "async"],
    "straggler_reps": 2,
    "straggler_window_s": 1.0,
    "straggler_strategies": ["ddp", "async", "softsync2"],
    "epoch_learners": [2, 4],
    "epoch_slowdowns": [3],
    "epochs_per_run": 3,
    "epoch_reps": 1,
    "epoch_samples": 3000,
    "epoch_calibration_steps": 50,
    "epoch_target_accuracy": 0.3,
    "models": [{"params": 10 * M, "learners": 2, "samples": 384, "epochs": 3, "reps": 1}],
    "accuracy_learners": [2, 4],
    "accuracy_slowdowns": [3, 1],
    "accuracy_epochs": 2,
    "accuracy_reps": 1,
    "accuracy_samples": 3000,
    "network": [{"rate": "1gbit", "learners_per_host": 1, "reps": 1}],
    "network_params": 10 * M,
    "network_steps": 4,
    "network_epochs": 2,
    "network_strategies": ["ddp", "hardsync", "async+bf16"],
}
PHASES = ("transport", "variants", "prototypes", "e2e", "straggler", "epochs", "models", "accuracy", "network")
TRAINING = {"batch_size": 32, "lr": 0.1, "momentum": 0.5, "seed": 42, "num_samples": 4000, "warmup": 10}
# models phase: μ per learner, whatever λ; samples/s and step times after 2 warm-up batches (the first
# allocations, DDP's buckets, the server's first reply), as the runs are short
MODEL_TRAINING = {"batch_size": 32, "warmup": 2}
MODEL_STRATEGIES = ["ddp", "hardsync", "async", "async+rpc", "hardsync+2servers", "async+2servers"]  # no straggler
MODEL_STRAGGLER_STRATEGIES = ["ddp", "async", "async+2servers"]
MODEL_SLOWDOWN = 3
EPOCH_BATCH = 64  # μ·λ in the epochs phase, the same for every λ (the paper's rule): μ = 32 at λ = 2, 16 at 4
TRAINING_PRELOAD = (
    "pytorch_lightning",
    "lightning_rudra",
    "examples.mnist1d",
    "benchmarks.synthetic",
    "benchmarks.training",
)


def _iters(size: int) -> int:
    return 21 if size < 1 * M else 7 if size <= 1 * M else 5 if size <= 10 * M else 3


def _rounds(size: int, rounds: int) -> int:
    return min(rounds, 2) if size > 10 * M else rounds  # 50 M: a round takes ~15 s here


class Ports:
    """Distinct free TCP ports (a rendezvous per job: RPC and gloo must never share one)."""

    def __init__(self) -> None:
        self.used: set[int] = set()

    def __call__(self) -> int:
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            if port not in self.used:
                self.used.add(port)
                return port


class Suite:
    def __init__(self, cfg: dict[str, Any], quick: bool) -> None:
        self.cfg = cfg
        self.quick = quick
        self.ports = Ports()
        self.t0 = time.monotonic()
        self.failures: list[str] = []
        self.raw: dict[str, Any] = {}
        self.summary: dict[str, Any] = {}
        self.pools: dict[str, Pool] = {}

    def log(self, message: str) -> None:
        print(f"[{time.monotonic() - self.t0:5.0f} s] {message}", file=sys.stderr, flush=True)

    def job(self, pool: str, fn: str, timeout: float, **kwargs: Any) -> Optional[list[Any]]:
        try:
            return self.pools[pool].run(fn, timeout, **kwargs)
        except JobFailed as error:
            text = str(error)
            self.failures.append(
                f"{fn} {json.dumps({k: v for k, v in kwargs.items() if 'port' not in k})[:200]}: {text.splitlines()[0]}"
            )
            self.log(f"FAILED {fn}: {text[:3000]}")
            return None

    # ---- phases ------------------------------------------------------------------------------------------
    def start_pools(self, phases: list[str]) -> None:
        if set(phases) <= {"network"}:  # it starts its workers on its hosts
            return
        self.pools["main"] = Pool("main", preload=TRAINING_PRELOAD + ("benchmarks.transport",))
        # idle workers would share the cores (and the memory) with every phase until prototypes closes them
        if "prototypes" in phases and any(p[1] == "thp" for p in PROTOTYPES if p[0] in self.cfg["prototypes"]):
            self.pools["thp"] = Pool("thp", env=THP, preload=("lightning_rudra", "benchmarks.transport"))
        for pool in self.pools.values():
            pool.start()
        for pool in self.pools.values():
            pool.wait_ready()
        self.log(f"workers ready: {', '.join(self.pools)}")

    def transport(self) -> None:
        raw: dict[str, Any] = {}
        for size in self.cfg["sizes"]:
            result = self.job(
                "main",
                "benchmarks.transport:rudra_transport",
                120 + 60 * size / (10 * M),
                numel=size,
                port=self.ports(),
                gloo_port=self.ports(),
                rounds=_rounds(size, self.cfg["transport_rounds"]),
                iters=_iters(size),
            )
            if result is None:
                continue
            raw[str(size)] = result[0]
            raw[str(size)]["both_rank1"] = result[1]["both"]
            e = report.summarize_transport({str(size): result[0]})[str(size)]
            self.log(
                f"transport {report._size_label(size)}: push+pull 2 learners {e['ms']['both']:.1f} ms, 1 learner "
                f"{e['ms']['solo']:.1f} ms, gloo {e['ms']['gloo']:.1f} ms, memcpy {e['ms']['memcpy']:.1f} ms"
            )
        self.raw["transport"] = raw
        self.summary.setdefault("transport", {})["rudra"] = report.summarize_transport(
            {k: {m: v for m, v in r.items() if m != "both_rank1"} for k, r in raw.items()}
        )
        for servers in self.cfg.get("transport_servers", []):  # each job with its own gloo and memcpy references
            sharded: dict[str, Any] = {}
            for size in self.cfg["sizes"]:
                result = self.job(
                    "main",
                    "benchmarks.transport:rudra_transport",
                    120 + 60 * size / (10 * M),
                    numel=size,
                    port=self.ports(),
                    gloo_port=self.ports(),
                    num_servers=servers,
                    rounds=_rounds(size, self.cfg["transport_rounds"]),
                    iters=_iters(size),
                    measures=("both", "solo", "gloo", "memcpy"),
                )
                if result is not None:
                    sharded[str(size)] = {m: v for m, v in result[0].items() if m != "clone"}
                    e = report.summarize_transport({str(size): sharded[str(size)]})[str(size)]
                    self.log(
                        f"transport {report._size_label(size)}, {servers} servers: push+pull 2 learners "
                        f"{e['ms']['both']:.1f} ms ({e['both_vs_gloo']:.2f}x gloo, {e['both_vs_memcpy']:.2f}x "
                        f"memcpy), 1 learner {e['ms']['solo']:.1f} ms"
                    )
            self.raw[f"transport_{servers}_servers"] = sharded
            self.summary["transport"].setdefault("servers", {})[str(servers)] = report.summarize_transport(sharded)

    def variants(self) -> None:
        variants = [v for v in VARIANTS if v["label"] in self.cfg["variants"]]
        sizes = self.cfg["variant_sizes"]
        rounds = self.cfg["variant_rounds"]
        result = self.job(
            "main",
            "benchmarks.transport:tp_variants",
            120 + 40 * rounds * len(variants),
            variants=variants,
            sizes=sizes,
            ports=[self.ports() for _ in range(rounds * len(variants))],
            rounds=rounds,
            iters=[_iters(x) if x > 1 * M else 5 for x in sizes],
        )
        if result is None:
            return
        self.raw["variants"] = result[0]
        reference = variants[0]["label"]
        summary = report.summarize_variants(result[0], reference)
        self.summary.setdefault("transport", {})["variants"] = summary
        self.summary["transport"]["variants_reference"] = reference
        for label, e in summary.items():
            self.log(
                f"TensorPipe {label}: "
                + (
                    e["error"]
                    or ", ".join(
                        f"{report._size_label(s)} {v['ms']:.1f} ms" for s, v in e.items() if s != "error" and v["ms"]
                    )
                )
            )

    def prototypes(self) -> None:
        configs = [p for p in PROTOTYPES if p[0] in self.cfg["prototypes"]]
        rounds = []
        for r in range(self.cfg["prototype_rounds"]):
            this_round = {}
            for label, pool, patches, server_env, learner_patches in configs:
                result = self.job(
                    pool,
                    "benchmarks.transport:rudra_transport",
                    180,
                    numel=10 * M,
                    port=self.ports(),
                    gloo_port=self.ports(),
                    rounds=1,
                    iters=5,
                    measures=["both", "solo", "memcpy", "breakdown"],
                    server_patches=patches,
                    server_env=server_env,
                    learner_patches=learner_patches,
                )
                if result is not None:
                    this_round[label] = {k: v[0] for k, v in result[0].items() if v}
                    self.log(
                        f"prototype round {r}: {label}: 2 learners {1e3 * this_round[label]['both']:.1f} ms, "
                        f"1 learner {1e3 * this_round[label]['solo']:.1f} ms"
                    )
            rounds.append(this_round)
        self.raw["prototypes"] = rounds
        self.summary.setdefault("transport", {})["prototypes"] = report.summarize_prototypes(rounds, configs[0][0])
        self.summary["transport"]["prototypes_reference"] = configs[0][0]
        self._close_extra_pools()

    def _close_extra_pools(self) -> None:
        """Pools a phase started for itself: idle workers must not share the cores with later phases."""
        for name in [n for n in self.pools if n != "main"]:
            self.pools.pop(name).close()

    def _train(
        self,
        key: str,
        rep: int,
        seq: int,
        pool: str = "main",
        timeout: float = 240,
        target: Optional[float] = None,
        snapshots: bool = False,
        **kwargs: Any,
    ) -> Optional[dict[str, Any]]:
        """One training job; ``kwargs`` go to ``training.train`` over ``TRAINING``; ``target``: the test accuracy
        for the time to accuracy (needs ``snapshot_every``); ``snapshots``: keep rank 0's (time, test accuracy)
        snapshots and final accuracy in the run, and where its training started (s after the first rank's), for a
        target known only later."""
        strategy, n, protos, options = STRATEGIES[key]
        t = {**TRAINING, **kwargs}
        start = time.monotonic()
        result = self.job(
            pool,
            "benchmarks.training:train",
            timeout,
            strategy=strategy,
            n=n,
            protos=protos,
            options=options,
            port=self.ports(),
            **t,
        )
        if result is None:
            return None
        result = [rank for rank in result if not rank.get("idle")]  # a server node, a worker the layout leaves out
        run = {
            "strategy": key,
            "rep": rep,
            "seq": seq,
            "job_wall_s": time.monotonic() - start,
            "parameters": result[0]["parameters"],
            **report.throughput(result, t["warmup"]),
        }
        if kwargs.get("max_epochs"):  # whole epochs: samples/s to the end replaces the window's
            run.update(report.epoch_times(result, t["warmup"]))
        if t.get("num_nodes", 1) > 1 and options.get("server_nodes"):  # every learner on host 0: its counters
            link = report.link_per_step(result, t["num_learners"], t["warmup"])  # host 1's are host 0's, mirrored
            run["link_per_step"] = link and [link[0], {"sent": link[0]["received"], "received": link[0]["sent"]}]
        elif t.get("num_nodes", 1) > 1:  # across hosts: the bytes on the link
            run["link_per_step"] = report.link_per_step(result, t["num_learners"] // t["num_nodes"], t["warmup"])
        if target is not None:
            run["tta_target"] = target
            run["tta_s"], run["best_accuracy"] = report.time_to_accuracy(result[0], target)
        if snapshots:
            run.update(
                accuracy=result[0].get("accuracy", []),
                final_accuracy=result[0].get("final_accuracy"),
                rank0_start_s=result[0]["start"] - min(r["start"] for r in result),
            )
        stats = result[0].get("stats")
        if stats:
            run["mean_staleness"] = stats["mean_staleness"]
            run["max_staleness"] = stats["max_staleness"]
            run["updates"] = stats["clock"]
            run["batches"] = stats["batches"]
        return run

    def _schedule(self, keys: list[str], reps: int) -> list[tuple[str, int]]:
        """DDP before every ``ddp_every`` other runs and once at the end, so that every run has a DDP run just
        before and just after it; the other strategies rotate, so none always runs first."""
        others = [k for k in keys if k != "ddp"]
        every = self.cfg["ddp_every"]
        order: list[tuple[str, int]] = []
        for rep in range(reps):
            for i, key in enumerate(others[rep % len(others) :] + others[: rep % len(others)]):
                if i % every == 0:
                    order.append(("ddp", rep))
                order.append((key, rep))
        return order + [("ddp", reps)]

    def e2e(self) -> None:
        runs = []
        steps = self.cfg["e2e_steps"]
        for seq, (key, rep) in enumerate(self._schedule(self.cfg["e2e_strategies"], self.cfg["e2e_reps"])):
            run = self._train(
                key,
                rep,
                seq,
                max_steps=[steps, steps],
                sleep_s=[0.0, 0.0],
                snapshot_every=self.cfg["snapshot_every"],
                target=self.cfg["target_accuracy"],
            )
            if run is not None:
                runs.append(run)
                self.log(
                    f"e2e rep {rep} {key}: {run['samples_per_s'] or 0:.0f} samples/s, step "
                    f"{run.get('step_ms') or 0:.1f} ms, time to {run['tta_target']}: {run['tta_s']} s "
                    f"(job {run['job_wall_s']:.1f} s)"
                )
        self.raw["e2e"] = runs
        self.summary["e2e"] = report.summarize_runs(runs)
        self.summary["e2e_info"] = {
            "target": self.cfg["target_accuracy"],
            "text": (
                f"MNIST-1D example CNN (`examples/mnist1d.py`, 8 k parameters), 2 learners, μ = "
                f"{TRAINING['batch_size']} per learner, SGD lr {TRAINING['lr']} momentum {TRAINING['momentum']}, "
                f"{steps} steps per learner, {self.cfg['e2e_reps']} runs of each strategy; DDP runs before every "
                f"{self.cfg['ddp_every']} other runs and at the end. *samples/s*: all learners' samples over "
                f"the window where both are past {TRAINING['warmup']} batches and neither has stopped (median "
                f"of runs). *vs DDP*: each run against the mean of the DDP runs just before and just after it, "
                f"median (lowest–highest) over runs. *Time to accuracy*: from the start of training to the "
                f"first rank-0 snapshot (every {self.cfg['snapshot_every']} steps) at or above "
                f"{self.cfg['target_accuracy']} test accuracy (800 test samples). mean σ: staleness in server "
                f"updates."
            ),
        }

    def straggler(self) -> None:
        ddp_step = self.summary.get("e2e", {}).get("ddp", {}).get("step_ms")
        if ddp_step is None:
            self.failures.append("straggler: no DDP step time from the end-to-end runs to calibrate the sleep")
            return
        sleep = 2 * ddp_step / 1e3
        window = self.cfg["straggler_window_s"]
        warmup = TRAINING["warmup"]
        ddp_steps = warmup + 5 + math.ceil(window / (3 * ddp_step / 1e3))
        runs = []
        for seq, (key, rep) in enumerate(self._schedule(self.cfg["straggler_strategies"], self.cfg["straggler_reps"])):
            if key == "ddp":  # lock-step: both ranks must run the same number of steps
                kwargs = {"max_steps": [ddp_steps, ddp_steps]}
            else:  # independent learners: each stops on its own clock
                kwargs = {"max_steps": [100_000, 100_000], "stop_after_s": [window, window]}
            run = self._train(key, rep, seq, sleep_s=[0.0, sleep], snapshot_every=0, **kwargs)
            if run is not None:
                runs.append(run)
                self.log(
                    f"straggler rep {rep} {key}: {run['samples_per_s'] or 0:.0f} samples/s, steps in "
                    f"window {run.get('batches_in_window')}"
                )
        self.raw["straggler"] = runs
        self.summary["straggler"] = report.summarize_runs(runs)
        self.summary["straggler_info"] = {
            "text": (
                f"Same module and settings; learner 1 sleeps {1e3 * sleep:.1f} ms per batch (2x the median DDP step "
                f"time of section 2, {ddp_step:.1f} ms), so it is 3x slower. DDP runs {ddp_steps} steps per learner; "
                f"Rudra learners run {window:g} s each after warm-up. {self.cfg['straggler_reps']} runs of each, "
                f"ratios against the DDP runs just before and after, as in section 2."
            )
        }

    def epochs(self) -> None:
        raw: list[dict[str, Any]] = []
        configs: list[dict[str, Any]] = []
        # published first and filled in as measured: a failure later in the phase keeps what came before it
        self.raw["epochs"], self.summary["epochs"] = raw, configs
        self.summary["epochs_info"] = {
            "target": self.cfg["epoch_target_accuracy"],
            "text": (
                f"MNIST-1D example module, {self.cfg['epoch_samples']} samples (72 % of them the train split), "
                f"μ·λ = {EPOCH_BATCH} (μ per learner in the first column), SGD lr {TRAINING['lr']} momentum "
                f"{TRAINING['momentum']}, {self.cfg['epochs_per_run']} epochs per run, no step limit. The last learner "
                f"sleeps (k − 1)·t before every batch, t being the median DDP step time without a straggler for that λ "
                f"and μ, measured in this run ({self.cfg['epoch_calibration_steps']} steps). *Epoch s*: an epoch ends "
                f"when its last learner ends it (`on_train_epoch_end`, host monotonic clock); median of the times "
                f"between consecutive epoch ends, the first epoch left out as warm-up. Rudra async with its default "
                f"shared epoch, DDP (gloo) with Lightning's DistributedSampler. Runs of async per row: "
                f"{self.cfg['epoch_reps']}, each between two DDP runs, ratio to their mean, median (lowest–highest) over "
                f"runs. *Ideal*: shared epoch / DDP epoch without overhead, λ / (k·(λ − 1) + 1). *Straggler's share*: of "
                f"the batches the server dealt over the run (`stats.batches`); ideal 1 / (k·(λ − 1) + 1). *Time to "
                f"accuracy*: from the start of training to the first rank-0 snapshot (every "
                f"{self.cfg['snapshot_every']} of its batches) at or above {self.cfg['epoch_target_accuracy']} test "
                f"accuracy."
            ),
        }
        for learners in self.cfg["epoch_learners"]:
            pool = self._pool_for(learners)
            setup = {
                "num_learners": learners,
                "batch_size": EPOCH_BATCH // learners,
                "num_samples": self.cfg["epoch_samples"],
            }
            calibration = self._calibrate(pool, setup)
            if calibration is None:
                continue
            step_s = calibration["step_ms"] / 1e3
            raw.append({"learners": learners, "calibration": calibration, "runs": {}})
            for slowdown in self.cfg["epoch_slowdowns"]:
                runs = self._epoch_runs(pool, setup, step_s, slowdown)
                raw[-1]["runs"][f"{slowdown:g}x"] = runs
                configs.append(
                    {
                        "learners": learners,
                        "batch_size": setup["batch_size"],
                        "slowdown": slowdown,
                        "step_ms": 1e3 * step_s,
                        "sleep_ms": 1e3 * (slowdown - 1) * step_s,
                        "ideal": report.ideal_epoch_ratio(learners, slowdown),
                        "runs": report.summarize_runs(runs),
                    }
                )
        self._close_extra_pools()

    def _pool_for(self, learners: int) -> str:
        """A pool with one worker per learner: "main" for its size, otherwise one started now (closed at the end of
        the phase, after the runs on "main", so that its start does not share the cores with a measurement)."""
        if learners == self.pools["main"].size:
            return "main"
        name = f"learners{learners}"
        if name not in self.pools:
            self.pools[name] = Pool(name, size=learners, preload=TRAINING_PRELOAD)
            self.pools[name].wait_ready()
            self.log(f"workers ready: {name}")
        return name

    def _calibrate(self, pool: str, setup: dict[str, Any], phase: str = "epochs") -> Optional[dict[str, Any]]:
        """A short DDP run without a straggler: its median step time is the t that a straggler's sleep is scaled by
        (``setup``: more arguments of ``training.train``)."""
        steps = [self.cfg["epoch_calibration_steps"]] * setup["num_learners"]
        run = self._train("ddp", 0, 0, pool=pool, max_steps=steps, sleep_s=[0.0] * len(steps), **setup)
        if run is None or run.get("step_ms") is None:
            self.failures.append(
                f"{phase}: no DDP step time for {setup['num_learners']} learners to calibrate the straggler's sleep"
            )
            return None
        self.log(f"{phase} {setup['num_learners']} learners: DDP step {run['step_ms']:.1f} ms without a straggler")
        return run

    def _epoch_runs(self, pool: str, setup: dict[str, Any], step_s: float, slowdown: float) -> list[dict[str, Any]]:
        learners = setup["num_learners"]
        epochs = self.cfg["epochs_per_run"]
        sleep = [0.0] * (learners - 1) + [(slowdown - 1) * step_s]  # the last rank is the straggler
        # the longest run is DDP's, every step as slow as the straggler's (num_samples bounds the train split)
        ddp_s = epochs * setup["num_samples"] / EPOCH_BATCH * slowdown * step_s
        runs = []
        for seq, (key, rep) in enumerate(self._schedule(["ddp", "async"], self.cfg["epoch_reps"])):
            run = self._train(
                key,
                rep,
                seq,
                pool=pool,
                timeout=120 + 3 * ddp_s,
                max_epochs=epochs,
                sleep_s=sleep,
                snapshot_every=self.cfg["snapshot_every"],
                target=self.cfg["epoch_target_accuracy"],
                **setup,
            )
            if run is None:
                continue
            if run.get("batches"):
                run["straggler_share"] = report.straggler_share(run["batches"], learners - 1)
            runs.append(run)
            self.log(
                f"epochs {learners} learners, {slowdown:g}x, rep {rep} {key}: epoch {report._f(run['epoch_s'])} "
                f"s ({', '.join(f'{x:.2f}' for x in run['epoch_times_s'])}), straggler's share "
                f"{report._f(run.get('straggler_share'))}, time to {run['tta_target']}: {report._f(run['tta_s'])} "
                f"s (best {report._f(run['best_accuracy'], '{:.3f}')}; job {run['job_wall_s']:.1f} s)"
            )
        return runs

    def models(self) -> None:
        raw: list[dict[str, Any]] = []
        configs: list[dict[str, Any]] = []
        self.raw["models"], self.summary["models"] = raw, configs  # filled in as measured, as in epochs
        self.summary["models_info"] = {
            "text": (
                f"MLP classifiers (`benchmarks/synthetic.py`: 1000 inputs, 3 hidden layers of one width, 10 classes) on "
                f"synthetic data (standard normal inputs labelled by a random linear teacher), μ = "
                f"{MODEL_TRAINING['batch_size']} per learner, SGD lr {TRAINING['lr']} momentum "
                f"{TRAINING['momentum']}, whole epochs, no step limit. *samples/s*: all learners' batches from the point "
                f"where every learner is past {MODEL_TRAINING['warmup']} batches to the end of the last epoch (when its "
                f"last learner ends it), so every epoch's end and the waiting for the last learner count. *epoch s*: "
                f"median time between consecutive epoch ends, the first left out (under the shared epoch a fast learner "
                f"does not wait for the straggler at an epoch's end, so these vary). Rudra with its default "
                f"options (async: the shared epoch; hardsync: DistributedSampler, as DDP; shared memory on), and async "
                f"with `shared_memory=False` (everything through RPC). *vs DDP*: each run against the mean of the DDP "
                f"(gloo) runs just before and after it, median (lowest–highest) over runs. *Straggler*: the last "
                f"learner sleeps ({MODEL_SLOWDOWN} − 1)·t before every batch, t being the median DDP step time of the "
                f"runs without a straggler above it."
            )
        }
        for spec in self.cfg["models"]:
            pool = self._pool_for(spec["learners"])
            setup = {
                **MODEL_TRAINING,
                "mlp_params": spec["params"],
                "num_learners": spec["learners"],
                "num_samples": spec["samples"],
                "max_epochs": spec["epochs"],
            }
            config = {
                "target_params": spec["params"],
                "learners": spec["learners"],
                "batch_size": MODEL_TRAINING["batch_size"],
                "samples": spec["samples"],
                "epochs": spec["epochs"],
            }
            raw.append({**config, "runs": [], "straggler_runs": []})
            # for the timeouts until DDP has measured a step: 100 ms per million parameters, about 3x DDP's step
            # at 10 M with 2 learners on the README's 2-core machine
            guess_s = 0.1 * spec["params"] / M
            runs = self._model_runs(
                pool, setup, spec["reps"], MODEL_STRATEGIES, [0.0] * spec["learners"], guess_s, raw[-1]["runs"]
            )
            config.update(
                parameters=runs[0]["parameters"] if runs else spec["params"],
                runs=report.summarize_runs(runs),
                straggler={},
            )
            configs.append(config)
            step_ms = config["runs"].get("ddp", {}).get("step_ms")
            if step_ms is None:
                self.failures.append(
                    f"models {report._size_label(spec['params'])}, {spec['learners']} learners: "
                    f"no DDP step time to calibrate the straggler's sleep"
                )
                continue
            config.update(step_ms=step_ms, slowdown=MODEL_SLOWDOWN, sleep_ms=(MODEL_SLOWDOWN - 1) * step_ms)
            sleep = [0.0] * (spec["learners"] - 1) + [config["sleep_ms"] / 1e3]  # the last rank is the straggler
            runs = self._model_runs(
                pool, setup, spec["reps"], MODEL_STRAGGLER_STRATEGIES, sleep, step_ms / 1e3, raw[-1]["straggler_runs"]
            )
            config["straggler"] = report.summarize_runs(runs)
        self._close_extra_pools()

    def _model_runs(
        self,
        pool: str,
        setup: dict[str, Any],
        reps: int,
        keys: list[str],
        sleep: list[float],
        step_s: float,
        runs: list[dict[str, Any]],
    ) -> list[dict[str, Any]]:
        """The runs of one model size, λ and straggler, appended to ``runs`` as they are measured; ``step_s``: a
        DDP step without the straggler, for the timeout."""
        steps = setup["max_epochs"] * setup["num_samples"] / (setup["batch_size"] * setup["num_learners"])
        timeout = 120 + 3 * steps * (step_s + max(sleep))  # the longest run: DDP, every step waits for the straggler
        label = f"models {report._size_label(setup['mlp_params'])}, {setup['num_learners']} learners" + (
            f", straggler +{1e3 * max(sleep):.0f} ms" if max(sleep) else ""
        )
        for seq, (key, rep) in enumerate(self._schedule(keys, reps)):
            run = self._train(key, rep, seq, pool=pool, timeout=timeout, sleep_s=sleep, **setup)
            if run is not None:
                runs.append(run)
                self.log(
                    f"{label}, rep {rep} {key}: {report._f(run.get('samples_per_s'), '{:.0f}')} samples/s, "
                    f"step {report._f(run.get('step_ms'), '{:.1f}')} ms, epochs "
                    f"{', '.join(f'{x:.2f}' for x in run['epoch_times_s'])} s (job {run['job_wall_s']:.1f} s)"
                )
        return runs

    def accuracy(self) -> None:
        accuracy.phase(self)

    def network(self) -> None:
        network.phase(self)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()


def _meta(quick: bool) -> dict[str, Any]:
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass

    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "?"

    def git(*args: str) -> str:
        try:
            import subprocess

            return subprocess.run(
                ["git", *args],
                capture_output=True,
                text=True,
                timeout=10,
                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            ).stdout.strip()
        except Exception:
            return "?"

    return {
        "mode": "quick" if quick else "default",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": git("rev-parse", "--short", "HEAD"),
        "package_modified": bool(git("status", "--porcelain", "--", "lightning_rudra")),
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "torch": version("torch"),
        "lightning": version("pytorch-lightning"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_start": os.getloadavg(),
    }


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes, settings and repeats: about 2 minutes")
    parser.add_argument(
        "--out",
        default=os.path.join("benchmarks", "results"),
        help="folder for latest.json and latest.md (default: benchmarks/results)",
    )
    parser.add_argument(
        "--only",
        default=",".join(PHASES),
        help="comma-separated phases to run (straggler needs e2e for its calibration; epochs, "
        "models and accuracy calibrate themselves)",
    )
    parser.add_argument(
        "--network",
        help="the network phase's configurations instead of the mode's, comma-separated: "
        "RATE:LEARNERS_PER_HOST:REPS[:STRATEGY/STRATEGY...], e.g. 1gbit:2:2:ddp/hardsync/hardsync+no_aggregation; "
        "LEARNERS_PER_HOST 1+s: DDP with 1 learner per host and +server_node strategies with both on host 0 and a "
        "server node on host 1 (1gbit:1:2:ddp/hardsync,1gbit:1+s:2:ddp/hardsync+server_node)",
    )
    args = parser.parse_args(argv)
    cfg = dict(QUICK if args.quick else DEFAULT)
    if args.network:
        cfg["network"] = [network.parse_spec(spec) for spec in args.network.split(",")]
    phases = [p for p in args.only.split(",") if p]
    meta = _meta(args.quick)
    suite = Suite(cfg, args.quick)
    suite.log(f"lightning_rudra benchmark, {meta['mode']} mode, phases: {', '.join(phases)}")
    try:
        suite.start_pools(phases)
        for phase in PHASES:
            if phase in phases:
                try:
                    getattr(suite, phase)()
                except Exception as error:  # keep what the other phases measured
                    suite.failures.append(f"{phase}: {type(error).__name__}: {error}")
                    suite.log(f"phase {phase} failed:\n{traceback.format_exc()}")
    finally:
        suite.close()
    meta["duration_s"] = time.monotonic() - suite.t0
    meta["loadavg_end"] = os.getloadavg()
    meta["config"] = {**cfg, "training": TRAINING}
    suite.summary["targets"] = report.check_targets(suite.summary)
    result = {"meta": meta, "summary": suite.summary, "raw": suite.raw, "failures": suite.failures}
    markdown = report.render_markdown(result)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "latest.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "latest.md"), "w") as f:
        f.write(markdown)
    print(markdown)
    suite.log(f"wrote {os.path.join(args.out, 'latest.json')} and latest.md")
    return result


if __name__ == "__main__":
    main()
