"""Learner processes for the RPC tests: real processes, a real server process, no Lightning."""

import io
import os
import time
import traceback
from queue import Empty
from typing import Optional

import torch
import torch.multiprocessing as mp

from lightning_rudra.core.lookahead import StepAhead
from lightning_rudra.core.update import Push
from lightning_rudra.learner.world import join, leave
from lightning_rudra.learner.learner import Learner
from lightning_rudra.transport.rpc_world import StageWorld, free_port
from lightning_rudra.learner.sampler import SharedEpochSampler
from lightning_rudra.server.forked_server import STARTER_ENV
from lightning_rudra.server.starter import SERVER_STARTER

DATA_SEED = 1234
SERVER_PIDS: list[int] = []  # in a learner process: the server processes it started (forked: not its children)


def data(num_samples: int = 96):
    g = torch.Generator().manual_seed(DATA_SEED)
    return torch.randn(num_samples, 6, generator=g), torch.randn(num_samples, 1, generator=g)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def run_learners(
    num_learners: int, target, timeout: float = 20.0, num_servers: int = 1, stderr: Optional[str] = None, **kwargs
):
    """Run ``target(rank, clients, **kwargs)`` in ``num_learners`` processes around ``num_servers`` server
    processes (``clients``: one per server). Returns each learner's result (or the text of its exception), in rank
    order. ``stderr``: a file that the learners' and the servers' standard error go to."""
    port = free_port()
    # forked from one fork server that imported torch and the package once for the session (seconds per learner)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    queue = ctx.Queue()
    environ = dict(os.environ)  # a fork server's children have the environment of when it started
    environ[STARTER_ENV] = SERVER_STARTER.ensure_running()  # the server processes are forked too
    procs = [
        ctx.Process(
            target=_learner_main,
            args=(rank, num_learners, port, timeout, num_servers, target, kwargs, queue, environ, stderr),
        )
        for rank in range(num_learners)
    ]
    for proc in procs:
        proc.start()
    results = {}
    while len(results) < num_learners and any(p.is_alive() for p in procs) or not queue.empty():
        try:
            rank, payload = queue.get(timeout=0.5)
        except Empty:
            continue
        results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    for proc in procs:
        proc.join(timeout=2 * timeout)
        if proc.is_alive():
            proc.kill()
    return [results.get(r, f"died with exit code {procs[r].exitcode}") for r in range(num_learners)]


def _learner_main(rank, num_learners, port, timeout, num_servers, target, kwargs, queue, environ, stderr):
    os.environ.clear()
    os.environ.update(environ)
    if stderr is not None:  # before the servers start: they inherit it
        with open(stderr, "ab") as file:
            os.dup2(file.fileno(), 2)
    torch.set_num_threads(1)
    clients, processes = [], []
    try:
        clients, processes = join(rank, StageWorld("127.0.0.1", port, num_learners, timeout, (0,) * num_servers))
        SERVER_PIDS[:] = [process.pid for process in processes]
        result = target(rank, clients, **kwargs)
    except BaseException as error:  # report it to the test instead of dying silently
        result = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
    finally:
        if clients:
            leave(clients, processes, timeout=5.0)
    buffer = io.BytesIO()  # bytes, not shared-memory tensors: this process may exit before they are read
    torch.save(result, buffer)
    queue.put((rank, buffer.getvalue()))


class SubclassedSGD(torch.optim.SGD):
    """SGD under another class: not known to be elementwise, so several servers are cut between parameters."""


def start(  # 9 params: train's
    rank,
    clients,
    config,
    lr=0.1,
    momentum=0.0,
    overlap=False,
    shared_memory=True,
    optimizer=torch.optim.SGD,
    bucket_cap_mb=None,
):
    """A learner on the test model: learner 0 registers it, every learner pulls the starting weights."""
    net = model()
    opt = optimizer(net.parameters(), lr=lr, momentum=momentum)
    learner = Learner(net, clients, overlap, shared_memory, bucket_cap_mb=bucket_cap_mb)
    [wrapped] = learner.wrap([opt])
    if rank == 0:
        learner.register(config, [opt], None)
    learner.pull()
    return net, learner, wrapped


def refuse_shared_memory_of_server_1():
    """In a learner's process: server 1's shared memory cannot be mapped, as one on another host's: its pushes and
    their replies carry the tensors over the push stream; server 0's go through shared memory."""
    from lightning_rudra.learner import link

    mapped = link.MappedWeights

    def refused(names, rank, what, *args):
        if "parameter server 1" in what:
            raise OSError("refused by the test, as another host's /dev/shm")
        return mapped(names, rank, what, *args)

    link.MappedWeights = refused


def closure(net, wrapped, rows, after_backward=None):
    """A step's forward and backward pass, run by its optimizer (as Lightning's automatic optimization does)."""
    x, y = data()
    wrapped.zero_grad()
    loss = torch.nn.functional.mse_loss(net(x[rows]), y[rows])
    loss.backward()
    if after_backward is not None:
        after_backward(net)
    return loss


def step(net, wrapped, rows):
    x, y = data()
    wrapped.zero_grad()
    torch.nn.functional.mse_loss(net(x[rows]), y[rows]).backward()
    wrapped.step()


def train(
    rank,
    clients,
    config,
    steps,
    mu,
    lr=0.1,
    momentum=0.9,
    overlap=False,
    shared_memory=True,
    optimizer=torch.optim.SGD,
    delays=None,
    bucket_cap_mb=None,
    after_backward=None,
    step_ahead=False,
):
    """μ samples per learner per step, rank r taking rows r, r+λ, ... of each μλ block (as DistributedSampler).
    ``delays``: rank -> seconds that learner sleeps before each step (a straggler). With ``bucket_cap_mb``, the
    backward pass runs in the step's closure (as Lightning's), then ``after_backward(net)`` if given. ``step_ahead``:
    the learner takes its own steps under overlap (:class:`StepAhead`, as the strategy sets them with dana)."""
    net, learner, wrapped = start(rank, clients, config, lr, momentum, overlap, shared_memory, optimizer, bucket_cap_mb)
    lam = config.num_learners
    if step_ahead:
        learner.step_ahead = StepAhead(config.gradients_per_update, undo=config.max_staleness is not None)
    pushes = []
    learner.on_push = lambda optimizer, status, sigma, lr_scale: pushes.append((status, sigma))
    for i in range(steps):
        time.sleep((delays or {}).get(rank, 0.0))
        rows = torch.arange(i * mu * lam, (i + 1) * mu * lam)[rank::lam]
        if bucket_cap_mb is None:
            step(net, wrapped, rows)
        else:
            wrapped.step(lambda: closure(net, wrapped, rows, after_backward))
    learner.finish()
    stats = clients[0].stats() if rank == 0 else None
    return {
        "params": [p.detach().clone() for p in net.parameters()],
        "stats": stats,
        "pushes": pushes,
        "owned": [len(link.params) for link in learner.links],
        "shared_memory": all(link.shm is not None for link in learner.links),
        "mapped": [link.shm is not None for link in learner.links],
    }


def push_garbage(rank, clients, config):
    """Learner 0 registers a model, pushes a gradient of the wrong size, then reports the server's weights."""
    start(rank, clients, config)
    client = clients[0]
    before, _ = client.pull()
    try:
        client.receive(
            client.push(
                Push(
                    client.rank,
                    0,
                    [torch.ones(3)],
                    torch.ones(4, dtype=torch.bool),
                    client.timestamp,
                    [{"lr": 0.1}],
                    [],
                )
            )
        )
        error = None
    except Exception as exc:
        error = str(exc)
    after, _ = client.pull()
    return {"error": error, "unchanged": all(torch.equal(a, b) for a, b in zip(before, after)), "stats": client.stats()}


def die_after_one_step(rank, clients, config):
    """Learner 1 exits abruptly after its first push; learner 0 keeps training under hardsync."""
    net, _, wrapped = start(rank, clients, config)
    for _ in range(3):
        step(net, wrapped, torch.arange(4))
        if rank == 1:
            os._exit(1)
    return "finished"


def slow_first_push(rank, clients, config, sleep_s):
    """hardsync: learner 1 sleeps ``sleep_s`` (longer than the RPC timeout) before its first push."""
    net, _, wrapped = start(rank, clients, config)
    for i in range(3):
        if rank == 1 and i == 0:
            time.sleep(sleep_s)
        step(net, wrapped, torch.arange(4))
    return {"params": [p.detach().clone() for p in net.parameters()]}


def draw_shared_epochs(rank, clients, config, plan, epochs, sleep_s):
    """Each learner iterates a DataLoader over the shared epoch; learner 1 sleeps ``sleep_s`` per batch."""
    start(rank, clients, config)
    sampler = SharedEpochSampler(clients[0], 0, plan)
    loader = torch.utils.data.DataLoader(list(range(plan.num_samples)), batch_sampler=sampler)
    batches = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            batches.append((epoch, batch.tolist()))
            time.sleep(sleep_s if rank == 1 else 0.0)
    return {"batches": batches, "positions": list(sampler.positions)}
