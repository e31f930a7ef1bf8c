"""The suite's runner: its worker pools, one job or one training run with its measurements, the order in which
runs alternate with DDP; each phase's method runs that phase's module.
"""

import json
import sys
import time
from typing import Any, Optional

from benchmarks import accuracy, e2e, epochs, models, network, stats, transport_phases
from benchmarks.config import PROTOTYPES, STRATEGIES, THP, TRAINING, TRAINING_PRELOAD
from benchmarks.pool import JobFailed, Pool
from lightning_rudra.transport.rpc_world import free_port


class Suite:
    def __init__(self, cfg: dict[str, Any], quick: bool) -> None:
        self.cfg = cfg
        self.quick = quick
        self.ports = free_port  # distinct ports: a rendezvous per job, RPC and gloo never sharing one
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

    def publish(self, phase: str, text: str, **info: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """A phase's raw runs and summary rows, published now and filled in as measured (a failure later in the
        phase keeps what came before it), and its description in the report (``text``, more of it in ``info``)."""
        raw: list[dict[str, Any]] = []
        configs: list[dict[str, Any]] = []
        self.raw[phase], self.summary[phase] = raw, configs
        self.summary[f"{phase}_info"] = {**info, "text": text}
        return raw, configs

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
        if key == "hivemind":  # hivemind.Optimizer's peers, each its own process (benchmarks.peers)
            return self._hivemind(rep, seq, timeout, {**TRAINING, **kwargs})
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
            **stats.throughput(result, t["warmup"]),
        }
        if kwargs.get("max_epochs"):  # whole epochs: samples/s to the end replaces the window's
            run.update(stats.epoch_times(result, t["warmup"]))
        if all("compute_s" in rank for rank in result):
            run["compute_s"] = stats.median([rank["compute_s"] for rank in result])
        if t.get("num_nodes", 1) > 1 and options.get("server_nodes"):  # every learner on host 0: its counters
            link = stats.link_per_step(result, t["num_learners"], t["warmup"])  # host 1's are host 0's, mirrored
            run["link_per_step"] = link and [link[0], {"sent": link[0]["received"], "received": link[0]["sent"]}]
        elif t.get("num_nodes", 1) > 1:  # across hosts: the bytes on the link
            run["link_per_step"] = stats.link_per_step(result, t["num_learners"] // t["num_nodes"], t["warmup"])
        if target is not None:
            run["tta_target"] = target
            run["tta_s"], run["best_accuracy"] = stats.time_to_accuracy(result[0], target)
        if snapshots:
            run.update(
                accuracy=result[0].get("accuracy", []),
                final_accuracy=result[0].get("final_accuracy"),
                rank0_start_s=result[0]["start"] - min(r["start"] for r in result),
            )
        server = result[0].get("stats")
        if server:
            run["mean_staleness"] = server["mean_staleness"]
            run["max_staleness"] = server["max_staleness"]
            run["updates"] = server["clock"]
            run["batches"] = server["batches"]
            run["gradients"] = server["gradients"]
            run["late"] = server.get("late")
            run["redealt"] = server.get("redealt")
        return run

    def _hivemind(self, rep: int, seq: int, timeout: float, t: dict[str, Any]) -> Optional[dict[str, Any]]:
        """One run of ``benchmarks.peers.train_hivemind`` (``t``: ``training.train``'s arguments) as ``_train``'s
        run; its own timeout, at least 2 s a batch of peer 0 (hivemind steps far slower than DDP here)."""
        from benchmarks import peers

        batches = t.get("max_epochs", 1) * t["num_samples"] * 0.72 / (t["batch_size"] * t["num_learners"])
        start = time.monotonic()
        try:
            out = peers.train_hivemind(timeout=max(timeout, 120 + 2 * batches), **t)
        except peers.PeersFailed as error:
            self.failures.append(f"hivemind rep {rep}: {str(error).splitlines()[0]}")
            self.log(f"FAILED hivemind: {str(error)[:3000]}")
            return None
        return {"strategy": "hivemind", "rep": rep, "seq": seq, "job_wall_s": time.monotonic() - start, **out}

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

    def run(self, phase: str) -> None:
        """One phase (a name in ``config.PHASES``), by its module."""
        PHASE_RUNNERS[phase](self)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()


PHASE_RUNNERS = {
    "transport": transport_phases.transport,
    "variants": transport_phases.variants,
    "prototypes": transport_phases.prototypes,
    "e2e": e2e.e2e,
    "straggler": e2e.straggler,
    "epochs": epochs.phase,
    "models": models.phase,
    "accuracy": accuracy.phase,
    "network": network.phase,
}
