"""Transport jobs: what one synchronisation of a model's worth of float32 costs.

``rudra_transport`` runs in two workers around a real lightning_rudra server process (``join``, a
``Learner`` whose step is a push then a pull, async protocol so no push ever waits for another learner) and,
in the same processes and the same rounds, a gloo all-reduce of the same buffer (what DDP does every step),
a bare RPC echo to the same server process (the wire alone), a memcpy and a copy into new memory, and the
pieces of a push measured in-process (packing the gradient, the server's update and copy of the weights,
loading the reply). ``tp_variants`` measures a bare RPC round trip between the two workers under
TensorPipe transport and channel settings other than the one lightning_rudra pins.

Every function returns plain JSON: per measurement, a list with one median per round (seconds).
"""

import gc
import statistics
import time
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from lightning_rudra.core.update import Push

NUM_LEARNERS = 2


def _median_time(fn: Callable[[], Any], iters: int) -> float:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class _Flat(torch.nn.Module):
    """A model that is one float32 parameter of ``numel`` elements (a flat buffer, as the learner packs it)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(numel))


def rudra_transport(
    rank: int,
    *,
    numel: int,
    port: int,
    gloo_port: int,
    rounds: int,
    iters: int,
    measures: tuple[str, ...] = ("both", "solo", "echo", "gloo", "memcpy", "breakdown"),
    server_patches: tuple[str, ...] = (),
    server_env: Optional[dict[str, str]] = None,
    learner_patches: tuple[str, ...] = (),
    timeout: float = 120.0,
    num_servers: int = 1,
) -> dict[str, Any]:
    """``server_patches``: names in :data:`benchmarks.proto.PATCHES` that the server process runs with;
    ``server_env``: variables added to the server process's environment only; ``learner_patches``: names in
    :data:`benchmarks.proto.LEARNER_PATCHES` applied to both learners; ``num_servers``: server processes, each
    owning a contiguous part of the parameter (the breakdown measures one server's pieces)."""
    from lightning_rudra.learner.world import join, leave
    from lightning_rudra.learner.learner import Learner
    from lightning_rudra.core.protocol import ProtocolConfig
    from lightning_rudra.transport.rpc_world import SERVER_NAME, StageWorld, environment

    from benchmarks._echo import echo
    from benchmarks.proto import LEARNER_PATCHES, prototype_server

    out: dict[str, list[float]] = {m: [] for m in measures if m != "breakdown"}
    if "breakdown" in measures:
        out.update({"pack": [], "pack_reuse": [], "server_update": [], "load": []})
    with environment(dict(server_env or {})):  # the server process inherits learner 0's environment
        with prototype_server(server_patches if rank == 0 else ()):
            clients, processes = join(rank, StageWorld("127.0.0.1", port, NUM_LEARNERS, timeout, (0,) * num_servers))
    try:
        model = _Flat(numel)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-9)  # plain SGD: the cheapest server-side update
        learner = Learner(model, clients)
        learner.wrap([optimizer])
        for name in learner_patches:
            LEARNER_PATCHES[name](learner)
        config = ProtocolConfig(NUM_LEARNERS, "async", lr_modulation="none")
        if rank == 0:
            learner.register(config, [optimizer], None)
        learner.pull()
        model.weight.grad = torch.full((numel,), 1e-3)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=NUM_LEARNERS)
        buffer = torch.randn(numel)
        src, dst = torch.randn(numel), torch.empty(numel)
        push = lambda: learner.push(0, optimizer)  # noqa: E731 - the training step's whole exchange
        # warm-up: first calls set up connections and allocator state
        push()
        dist.all_reduce(buffer)
        if rank == 0 and "echo" in measures:
            rpc.rpc_sync(SERVER_NAME, echo, args=(src,), timeout=timeout)
        dst.copy_(src)
        for _ in range(rounds):
            if "both" in measures:  # both learners push at once: the same two processes as the all-reduce
                dist.barrier()
                out["both"].append(_median_time(push, iters))
            if "solo" in measures:  # learner 0 alone; learner 1 waits in the barrier
                dist.barrier()
                if rank == 0:
                    out["solo"].append(_median_time(push, iters))
            if "echo" in measures:  # the wire alone: the same bytes to the same server process and back
                dist.barrier()
                if rank == 0:
                    out["echo"].append(
                        _median_time(lambda: rpc.rpc_sync(SERVER_NAME, echo, args=(src,), timeout=timeout), iters)
                    )
            if "gloo" in measures:
                dist.barrier()
                out["gloo"].append(_median_time(lambda: dist.all_reduce(buffer), iters))
            if "memcpy" in measures:
                dist.barrier()
                if rank == 0:
                    out["memcpy"].append(_median_time(lambda: dst.copy_(src), iters))
                    out.setdefault("clone", []).append(_median_time(lambda: src.clone(), iters))
            if "breakdown" in measures:
                dist.barrier()
                if rank == 0:
                    _breakdown(out, learner, optimizer, numel, iters, server_patches)
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        leave(clients, processes, timeout=30.0)
        gc.collect()
    if rank != 0:
        out = {k: v for k, v in out.items() if k in ("both", "gloo")}
    return out


def _breakdown(out, learner, optimizer, numel, iters, server_patches) -> None:
    """The in-process pieces of one push: pack (learner), the server's update + copy of the weights (with the
    same patches as the server process), load."""
    from benchmarks.proto import patched_protocol
    from lightning_rudra.core.optimizers import hyperparameters

    protocol = patched_protocol(server_patches)
    Server, ProtocolConfig, OptimizerSpec = protocol.Server, protocol.ProtocolConfig, protocol.OptimizerSpec

    grad = learner.params[0].grad
    layout = learner.links[0].grad_layouts[0]
    out["pack"].append(_median_time(lambda: layout.pack([grad], torch.device("cpu")), iters))
    reused = torch.empty_like(grad)  # the same packing into a buffer kept from one push to the next
    out.setdefault("pack_reuse", []).append(_median_time(lambda: torch.cat([grad.reshape(-1)], out=reused), iters))
    weights = torch.zeros(numel)
    server = Server(
        ProtocolConfig(NUM_LEARNERS, "async", lr_modulation="none"),
        [weights],
        [],
        [OptimizerSpec.from_optimizer(torch.optim.SGD([weights], lr=1e-9), [weights])],
    )
    hparams = [hyperparameters(g) for g in optimizer.param_groups]
    has_grad = torch.ones(1, dtype=torch.bool)
    times = []
    for _ in range(iters):
        received = grad.clone()  # what TensorPipe hands the server: a new tensor, owned by the push
        start = time.perf_counter()
        server.push(Push(0, 0, [received], has_grad, server.clock, hparams, []))
        server.pull()
        times.append(time.perf_counter() - start)
    out["server_update"].append(statistics.median(times))
    reply = [grad.clone()]
    out["load"].append(_median_time(lambda: learner.load(reply, []), iters))


# ---- TensorPipe settings, bare round trips between the two workers ----------------------------------------
def tp_variants(
    rank: int,
    *,
    variants: list[dict[str, Any]],
    sizes: list[int],
    ports: list[int],
    rounds: int,
    iters: list[int],
    timeout: float = 60.0,
) -> dict[str, Any]:
    """Round trip of ``size`` float32 from worker 0 to worker 1 and back (``echo``), per TensorPipe setting.
    ``variants``: dicts with ``label``, ``transports`` and ``channels`` (None: TensorPipe's own choice).
    Rounds are the outer loop, so every setting is measured once per round, close in time to the others."""
    from benchmarks import _echo
    from benchmarks._echo import echo

    results: dict[str, dict[str, list[float]]] = {v["label"]: {str(s): [] for s in sizes} for v in variants}
    errors: dict[str, str] = {}
    tensors = {s: torch.randn(s) for s in sizes} if rank == 0 else {}
    port_iter = iter(ports)
    for _ in range(rounds):
        for variant in variants:
            port = next(port_iter)
            if variant["label"] in errors:
                continue
            kwargs: dict[str, Any] = {}
            if variant.get("transports") is not None:
                kwargs["_transports"] = variant["transports"]
            if variant.get("channels") is not None:
                kwargs["_channels"] = variant["channels"]
            options = rpc.TensorPipeRpcBackendOptions(
                init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=timeout, **kwargs
            )
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore")
                rpc.init_rpc(f"tp{rank}", rank=rank, world_size=2, rpc_backend_options=options)
            try:
                if rank == 0:
                    for size, n_iters in zip(sizes, iters):
                        x = tensors[size]
                        try:
                            rpc.rpc_sync("tp1", echo, args=(x,))  # warm-up, and a check
                            results[variant["label"]][str(size)].append(
                                _median_time(lambda: rpc.rpc_sync("tp1", echo, args=(x,)), n_iters)
                            )
                        except Exception as error:  # e.g. a channel this host does not allow
                            errors[variant["label"]] = f"{type(error).__name__}: {error}"[:300]
                            break
            finally:
                # Not torch's graceful shutdown: its final barrier runs through a store that worker 0 hosts, and
                # worker 1 then sometimes reads from a closed socket. Worker 0 says when it is done instead.
                if rank == 0:
                    try:
                        rpc.rpc_sync("tp1", _echo.signal_done, timeout=timeout)
                    except RuntimeError:
                        pass  # worker 1 left before its reply went out: it had the message, which is enough
                elif not _echo.done.wait(timeout=10 * timeout):
                    raise TimeoutError("worker 0 never said it was done")
                else:
                    time.sleep(0.2)  # let the reply to signal_done leave before the agent stops
                _echo.done.clear()
                rpc.shutdown(graceful=False)
    return {"times": results, "errors": errors} if rank == 0 else {}


def push_loop(rank: int, *, numel: int, port: int, seconds: float, both: bool = False, timeout: float = 120.0) -> int:
    """For profiling: learner 0 (and learner 1 with ``both``) pushes for ``seconds``; returns the push count."""
    from lightning_rudra.learner.world import join, leave
    from lightning_rudra.learner.learner import Learner
    from lightning_rudra.core.protocol import ProtocolConfig
    from lightning_rudra.transport.rpc_world import StageWorld

    clients, processes = join(rank, StageWorld("127.0.0.1", port, NUM_LEARNERS, timeout))
    count = 0
    try:
        model = _Flat(numel)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-9)
        learner = Learner(model, clients)
        learner.wrap([optimizer])
        if rank == 0:
            learner.register(ProtocolConfig(NUM_LEARNERS, "async", lr_modulation="none"), [optimizer], None)
        learner.pull()
        model.weight.grad = torch.full((numel,), 1e-3)
        end = time.monotonic() + seconds
        while (rank == 0 or both) and time.monotonic() < end:
            learner.push(0, optimizer)
            count += 1
        learner.finish()
    finally:
        leave(clients, processes, timeout=30.0)
    return count
