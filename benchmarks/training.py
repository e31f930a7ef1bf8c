"""End-to-end jobs: the MNIST-1D example module, or an MLP of a chosen size on synthetic data
(``benchmarks.synthetic``), trained by RudraStrategy or DDPStrategy, λ learners.

Each rank builds its own ``Trainer`` (the pool's workers look like torchrun's processes, so Lightning starts no
processes of its own), which lets one rank be a straggler. A callback records the monotonic time (one clock for
all processes of the host) at the end of every batch: the benchmark computes throughput over the window in
which every learner is past its warm-up and none has stopped, so process start, rendezvous, the server's start
and teardown are all excluded. It also records the end of every epoch, for runs of whole epochs. Rank 0 also
keeps a copy of its weights every few batches (the weights it continues from: after a push, the server's) and of
its final ones (Rudra: the server's, pulled after every learner finished); they are evaluated on the test split
after training, so measuring accuracy costs the run nothing. On a host of ``benchmarks.hosts`` (``RUDRA_BENCH_LINK``
names its end of the link), each host's first learner also records the link's byte counters at every batch's end.
"""

import gc
import os
import time
from typing import Any, Optional

import torch

_DATA: dict[str, Any] = {}
# a benchmark's Trainer: nothing logged, saved, printed or validated, so that only training is timed
QUIET = dict(
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    limit_val_batches=0,
)


def _data(mlp_params: Optional[int], num_samples: int, seed: int) -> dict[str, torch.Tensor]:
    """Train and test tensors, made once per worker: MNIST-1D as the example datamodule splits it (test 20%, the
    last 10% of the rest the validation split, ``x_val``: no job trains on it), or the MLP's synthetic task."""
    key = f"{'mnist1d' if mlp_params is None else 'synthetic'}-{num_samples}-{seed}"
    if key not in _DATA:
        if mlp_params is None:
            from examples.mnist1d import MNIST1DDataModule

            dm = MNIST1DDataModule(num_samples=num_samples, seed=seed)
            dm.setup("fit")
            _DATA[key] = {
                "x": dm.train_set.tensors[0],
                "y": dm.train_set.tensors[1],
                "x_val": dm.val_set.tensors[0],
                "y_val": dm.val_set.tensors[1],
                "x_test": dm.test_set.tensors[0],
                "y_test": dm.test_set.tensors[1],
            }
        else:
            from benchmarks.synthetic import teacher_data

            _DATA[key] = teacher_data(num_samples, seed)
    return _DATA[key]


def _model(mlp_params: Optional[int], **hparams: Any):
    """The MNIST-1D example CNN, or an MLP of about ``mlp_params`` parameters."""
    if mlp_params is None:
        from examples.mnist1d import MNIST1DClassifier

        return MNIST1DClassifier(**hparams)
    from benchmarks.synthetic import MLPClassifier

    return MLPClassifier(mlp_params, **hparams)


def compute_s(mlp_params: Optional[int], data: dict[str, torch.Tensor], batch_size: int, reps: int = 5) -> float:
    """Seconds of one step's forward and backward pass of a fresh copy of the model, nothing else (no hook, no
    communication): the median of ``reps`` after two to warm up, in the process and with the threads training
    had, as every learner of the job times its own at once."""
    model = _model(mlp_params)
    x, y = data["x"][:batch_size], data["y"][:batch_size]
    times = []
    for i in range(reps + 2):
        model.zero_grad()
        start = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        times.append(time.perf_counter() - start)
    return sorted(times[2:])[reps // 2]


def _busy_wait(seconds: float) -> None:
    """Hold the core for ``seconds``, as a slower device's compute would (a sleep would free it for the others)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _callback(
    rank: int,
    sleep_s: float,
    straggle: str,
    snapshot_every: int,
    warmup: int,
    stop_after_s: Optional[float],
    link: Optional[str],
):
    import pytorch_lightning as pl

    from benchmarks.hosts import link_counters

    class Recorder(pl.Callback):
        def __init__(self) -> None:
            self.start: Optional[float] = None
            self.end: Optional[float] = None
            self.times: list[float] = []
            self.link: list[tuple[int, int]] = []  # (sent, received) bytes at each time of ``times``
            self.epoch_ends: list[float] = []
            self.snapshots: list[tuple[float, list[torch.Tensor]]] = []
            self.final: Optional[tuple[float, list[torch.Tensor]]] = None

        def on_train_start(self, trainer, pl_module) -> None:
            self.start = time.monotonic()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if sleep_s > 0:  # the straggler: slower by this much per batch
                (_busy_wait if straggle == "busy" else time.sleep)(sleep_s)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            now = time.monotonic()
            self.times.append(now)
            if link is not None:
                self.link.append(link_counters(link))
            if snapshot_every and rank == 0 and len(self.times) % snapshot_every == 0:
                self.snapshots.append((now - self.start, [p.detach().clone() for p in pl_module.parameters()]))
            if stop_after_s is not None and len(self.times) > warmup and now - self.times[warmup - 1] >= stop_after_s:
                trainer.should_stop = True  # no collective: only for strategies whose learners run independently

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            self.epoch_ends.append(time.monotonic())

        def on_train_end(self, trainer, pl_module) -> None:
            # the strategy's on_train_end ran first (Rudra: every learner finished, final weights pulled)
            self.end = time.monotonic()
            if snapshot_every and rank == 0:  # the final weights, apart from the snapshots
                self.final = (self.end - self.start, [p.detach().clone() for p in pl_module.parameters()])

    return Recorder()


def _rudra_class(protos: list[str]):
    """RudraStrategy, or a prototype of a change to it (``protos``)."""
    from pytorch_lightning.strategies import ParallelStrategy

    from lightning_rudra import RudraStrategy

    if "quiet_log" not in protos:
        return RudraStrategy

    class QuietLogRudra(RudraStrategy):
        """Prototype: compute and log the staleness metrics only on the steps where Lightning writes logs
        (every ``log_every_n_steps``), not on every step. The change in RudraStrategy.training_step::

            if self._staleness_mean.update_count and self.lightning_module.trainer._logger_connector.should_update_logs:
        """

        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            if self.lightning_module.trainer._logger_connector.should_update_logs:
                return super().training_step(*args, **kwargs)
            return ParallelStrategy.training_step(self, *args, **kwargs)

    return QuietLogRudra


def _ddp(hook_name: Optional[str]):
    """Lightning's DDP on gloo; with ``hook_name`` (one of torch's ``default_hooks``) its gradients are all-reduced
    through that compression hook. Lightning registers a hook on CUDA only and ignores it on CPU without a word (a
    first check run put a float32 model's bytes on the link), though gloo all-reduces the compressed buckets: here it
    is registered on CPU too, and counted, so that a run without it cannot pass for one with it."""
    from pytorch_lightning.overrides.distributed import _register_ddp_comm_hook
    from pytorch_lightning.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if hook_name is None:
        return DDPStrategy(process_group_backend="gloo")
    hook = getattr(default_hooks, hook_name)

    class CompressedDDP(DDPStrategy):
        calls = 0

        def _register_ddp_hooks(self) -> None:
            _register_ddp_comm_hook(model=self.model, ddp_comm_state=None, ddp_comm_hook=self.counted)

        def counted(self, state, bucket):  # no annotations: DDP checks any it finds against its own types
            self.calls += 1
            return hook(state, bucket)

    return CompressedDDP(process_group_backend="gloo")


@torch.no_grad()
def _accuracy(model: torch.nn.Module, weights: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> float:
    for p, w in zip(model.parameters(), weights):
        p.copy_(w)
    model.eval()
    return (model(x).argmax(dim=1) == y).float().mean().item()


def _spare(server_node: bool, num_learners: int) -> tuple[str, int, int, int]:
    """In the server-node layout (2 workers per host, λ = ``num_learners`` = 2): this worker's role (``learner``,
    ``server node`` or ``idle``), its learner rank, and the Trainer's num_nodes and devices. With ``server_node``
    both learners are host 0's workers and host 1's first worker is the server node; without, one learner per
    host, its first worker."""
    node, local = int(os.environ["NODE_RANK"]), int(os.environ["LOCAL_RANK"])
    if server_node:
        role = "learner" if node == 0 else "server node" if local == 0 else "idle"
        return role, local, 1, num_learners
    return ("learner" if local == 0 else "idle"), node, 2, num_learners // 2


def train(
    rank: int,
    *,
    strategy: str,
    port: int,
    sleep_s: list[float],
    straggle: str = "sleep",
    max_steps: Optional[list[int]] = None,
    max_epochs: int = -1,
    num_learners: int = 2,
    num_nodes: int = 1,
    n: int = 1,
    batch_size: int = 32,
    lr: float = 0.05,
    momentum: float = 0.9,
    seed: int = 42,
    num_samples: int = 4000,
    snapshot_every: int = 0,
    warmup: int = 10,
    stop_after_s: Optional[list[Optional[float]]] = None,
    rpc_timeout: float = 60.0,
    protos: Optional[list[str]] = None,
    options: Optional[dict[str, Any]] = None,
    mlp_params: Optional[int] = None,
    layout: Optional[str] = None,
    profile: bool = False,
) -> dict[str, Any]:
    """``strategy``: ``ddp`` or a Rudra protocol (``hardsync``, ``softsync`` with ``n``, ``async``).
    ``max_steps``, ``sleep_s`` and ``stop_after_s`` are per rank (``num_learners`` of them; no ``max_steps``: no
    step limit, ``max_epochs`` ends the run); ``straggle``: how a rank spends its ``sleep_s`` before every batch,
    ``"sleep"`` (its core free for the others) or ``"busy"`` (a busy wait that holds its core, as a slow device's
    compute would); ``protos``: prototype changes to RudraStrategy; ``options``: more
    keyword arguments of RudraStrategy (``overlap``, ``shared_memory``); ``mlp_params``: train an MLP of about
    this many parameters on synthetic data instead of the MNIST-1D example; ``num_nodes``: the pool's hosts
    (``num_learners`` over all of them); ``layout="spare"``: the network phase's server-node layout (2 workers per
    host, :func:`_spare`); ``profile``: after training, time this learner's forward and backward pass alone
    (:func:`compute_s`)."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    os.environ["MASTER_PORT"] = str(port)  # read by the Trainer's cluster environment (RPC or gloo rendezvous)
    devices = num_learners // num_nodes
    if layout == "spare":
        role, rank, num_nodes, devices = _spare(bool((options or {}).get("server_nodes")), num_learners)
        if role == "idle":
            return {"idle": True}
    data = _data(mlp_params, num_samples, seed)
    pl.seed_everything(seed, verbose=False)
    model = _model(mlp_params, lr=lr, momentum=momentum)
    if strategy == "ddp":
        strat: Any = _ddp((options or {}).get("ddp_comm_hook"))
    else:
        strat = _rudra_class(protos or [])(protocol=strategy, n=n, rpc_timeout=rpc_timeout, **(options or {}))
    # one reader of the link per host: its first learner
    link = os.environ.get("RUDRA_BENCH_LINK") if os.environ.get("LOCAL_RANK") == "0" else None
    recorder = _callback(
        rank, sleep_s[rank], straggle, snapshot_every, warmup, (stop_after_s or [None] * num_learners)[rank], link
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=strat,
        max_steps=max_steps[rank] if max_steps else -1,
        max_epochs=max_epochs,
        callbacks=[recorder],
        **QUIET,
    )
    loader = DataLoader(TensorDataset(data["x"], data["y"]), batch_size=batch_size, shuffle=True)
    try:
        trainer.fit(model, train_dataloaders=loader)
    finally:
        if torch.distributed.is_initialized():  # a later Rudra job must not find a default process group
            torch.distributed.destroy_process_group()
    if layout == "spare" and role == "server node":  # its fit served the servers and returned
        return {"idle": True}
    if getattr(strat, "calls", None) == 0:
        raise RuntimeError(f"{options['ddp_comm_hook']} never ran: this DDP run all-reduced without it")
    result: dict[str, Any] = {
        "times": recorder.times,
        "link": recorder.link,
        "epoch_ends": recorder.epoch_ends,
        "start": recorder.start,
        "end": recorder.end,
        "batch_size": batch_size,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    if profile:
        result["compute_s"] = compute_s(mlp_params, data, batch_size)
    if rank == 0:
        if recorder.snapshots:
            probe = _model(mlp_params)
            result["accuracy"] = [
                (t, _accuracy(probe, w, data["x_test"], data["y_test"])) for t, w in recorder.snapshots
            ]
        if recorder.final is not None:
            probe = _model(mlp_params)
            result["final_accuracy"] = (
                recorder.final[0],
                _accuracy(probe, recorder.final[1], data["x_test"], data["y_test"]),
            )
        stats = getattr(trainer.strategy, "stats", None)
        if stats is not None:
            result["stats"] = {
                "clock": stats.clock,
                "gradients": stats.gradients,
                "mean_staleness": stats.mean_staleness,
                "max_staleness": stats.max_staleness,
                "batches": stats.batches,
                # batchsync, backup: gradients that came after their round closed, and their batches dealt again
                "late": stats.late,
                "redealt": stats.redealt,
            }
    del trainer, model, recorder
    gc.collect()
    return result


def sweep(
    rank: int,
    *,
    tasks: list[list[tuple[float, int]]],
    epochs: int,
    batch_size: int,
    momentum: float,
    seed: int,
    num_samples: int,
) -> list[dict[str, Any]]:
    """This rank's share (``tasks[rank]``: (lr, data order) pairs) of a rate sweep for DDP: DDP with μ·λ =
    ``batch_size`` does the arithmetic of plain SGD with that batch, so each pair trains the MNIST-1D CNN in this
    process, from the initial weights of :func:`train` (same ``seed``), ``epochs`` epochs of its train split in a
    random order (drawn from the order's seed), and is scored on the validation split, never the test split."""
    import pytorch_lightning as pl

    data = _data(None, num_samples, seed)
    x, y = data["x"], data["y"]
    out = []
    for lr, order in tasks[rank]:
        pl.seed_everything(seed, verbose=False)
        model = _model(None, lr=lr, momentum=momentum)
        optimizer = model.configure_optimizers()
        generator = torch.Generator().manual_seed(order)
        for _ in range(epochs):
            for batch in torch.randperm(len(y), generator=generator).split(batch_size):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
                optimizer.step()
        weights = [p.detach() for p in model.parameters()]
        out.append(
            {"lr": lr, "order": order, "val_accuracy": _accuracy(_model(None), weights, data["x_val"], data["y_val"])}
        )
    return out
