"""The learner's side of the parameter server: starting it, joining its RPC world, push, pull and
collectives. Every call has a timeout; nothing here knows about Lightning."""

import errno
import json
import os
import socket
import subprocess
import sys
import warnings
from typing import Any, Optional

import torch.distributed.rpc as rpc
from torch import Tensor
from torch.futures import Future

from lightning_rudra import server as _server
from lightning_rudra.protocol import OptimizerSpec, ProtocolConfig, Stats
from lightning_rudra.server import SERVER_NAME, learner_name


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """The RPC rendezvous listens on host:port; say so plainly if something else already does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host if host not in ("localhost", "") else "127.0.0.1", port))
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise
            raise RuntimeError(
                f"port {port} on {host} is already in use, so the learners cannot meet there. Set MASTER_PORT to "
                "a free port (or unset it to let Lightning pick one), or stop the process that holds it."
            ) from error


def rpc_counters() -> dict[str, Any]:
    """torch.distributed.rpc numbers, per process, its inits and its internal all-gathers (init and graceful
    shutdown use one each), and peers only meet when their numbers agree. A learner that already ran a stage
    (popen: fit, then test) is ahead of a new server process, which must start from the learners' numbers."""
    return {"init": rpc._init_counter, "all_gather": dict(rpc.api._all_gather_sequence_id)}


def set_rpc_counters(counters: dict[str, Any]) -> None:
    rpc._init_counter = counters["init"]
    rpc.api._all_gather_sequence_id.update(counters["all_gather"])


def init_rpc(name: str, rank: int, world_size: int, init_method: str, timeout: float) -> None:
    # "uv" (TCP): the shared-memory transport busy-polls, and idle waiting learners then starve the busy ones
    options = rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=timeout, _transports=["uv"])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*gloo.*")  # torch's deprecation notice, printed by every init
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)


def shutdown_rpc() -> None:
    """Leave the RPC world at once. Not torch's graceful shutdown: that is a barrier numbered by a process-wide
    C++ counter, so a learner's second stage would wait out the timeout for a new server that counts from 0.
    Callers meet through the server first (the learners' last gather, then every learner's ``leave``)."""
    rpc.shutdown(graceful=False)


# Not `python -m`: the RPC handlers must live in the module `lightning_rudra.server`, not in a copy named
# __main__. The package is entered without running its __init__, which imports Lightning (seconds, unused).
_SERVER_ENTRY = """import sys, types
package = types.ModuleType("lightning_rudra")
package.__path__ = [{package!r}]
sys.modules["lightning_rudra"] = package
from lightning_rudra.server import main
main()"""


def start_server(init_method: str, num_learners: int, timeout: float) -> subprocess.Popen:
    """Start the server process. It exits when every learner has left, or at once if this process dies."""
    env = dict(os.environ)
    # the server must import whatever the learner's optimizers are made of
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd()] + [p for p in sys.path if p])
    command = [sys.executable, "-c", _SERVER_ENTRY.format(package=os.path.dirname(__file__)),
               "--init-method", init_method, "--rpc-counters", json.dumps(rpc_counters()), "--learners", str(num_learners),
               "--timeout", str(timeout), "--parent-pid", str(os.getpid())]
    return subprocess.Popen(command, env=env)


def stop_server(process: subprocess.Popen, timeout: float) -> None:
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class LearnerClient:
    """One learner's calls to the server. Holds the timestamp of the weights the learner last received."""

    def __init__(self, rank: int, timeout: float) -> None:
        self.rank = rank
        self.timeout = timeout
        self.timestamp = 0
        self._collectives = 0

    def _sync(self, method: str, *args: Any) -> Any:
        return rpc.rpc_sync(SERVER_NAME, _server._call, args=(method, *args), timeout=self.timeout)

    def _wait(self, method: str, *args: Any) -> Any:
        return rpc.rpc_sync(SERVER_NAME, _server._call_async, args=(method, *args), timeout=self.timeout)

    def register(self, config: ProtocolConfig, params: list[Tensor], buffers: list[Tensor],
                 specs: list[OptimizerSpec], stats: Optional[Stats]) -> None:
        self._sync("register", config, params, buffers, specs, stats)

    def pull(self) -> tuple[list[Tensor], list[Tensor]]:
        params, buffers, self.timestamp = self._wait("pull")
        return params, buffers

    def push(self, optimizer: int, grads: list[Tensor], has_grad: Tensor, hparams: list[dict[str, Any]],
             buffers: list[Tensor]) -> Future:
        """Send a gradient computed from the weights last received; hand the future's value to :meth:`receive`.
        The tensors must not change until it resolves (RPC reads them when it sends them)."""
        return rpc.rpc_async(SERVER_NAME, _server._call_async, timeout=self.timeout, args=(
            "push", self.rank, optimizer, grads, has_grad, self.timestamp, hparams, buffers))

    def receive(self, reply: tuple) -> tuple[str, int, list[Tensor], list[Tensor]]:
        """What became of a pushed gradient (status, staleness) and the weights to continue from."""
        status, staleness, params, buffers, self.timestamp = reply
        return status, staleness, params, buffers

    def finish(self) -> tuple[list[Tensor], list[Tensor]]:
        """Stop pushing; wait for every learner to stop and return the final weights."""
        params, buffers, self.timestamp = self._wait("finish", self.rank)
        return params, buffers

    def gather(self, obj: Any) -> list[Any]:
        """Every learner's ``obj``, in rank order. All learners must call collectives in the same order."""
        self._collectives += 1
        return self._wait("gather", self._collectives, self.rank, obj)

    def leave(self) -> None:
        self._sync("leave", self.rank)

    def stats(self) -> Stats:
        return Stats.from_dict(self._sync("stats"))

    def optimizer_state(self, optimizer: int) -> dict[str, Any]:
        return self._sync("optimizer_state", optimizer)

    def load_optimizer_state(self, optimizer: int, state: dict[str, Any]) -> None:
        self._sync("load_optimizer_state", optimizer, state)


def join(rank: int, num_learners: int, host: str, port: int, timeout: float) -> tuple[LearnerClient, Optional[subprocess.Popen]]:
    """Join the RPC world of ``num_learners`` learners and one server; learner 0 checks the port and starts
    the server process. Returns the client and, on learner 0, the server process."""
    init_method = f"tcp://{host}:{port}"
    process = None
    if rank == 0:
        check_port_free(host, port)
        process = start_server(init_method, num_learners, timeout)
    try:
        init_rpc(learner_name(rank), rank, num_learners + 1, init_method, timeout)
    except BaseException:
        if process is not None:
            process.kill()
            process.wait()
        raise
    return LearnerClient(rank, timeout), process


def leave(client: LearnerClient, process: Optional[subprocess.Popen], timeout: float) -> None:
    """Leave the RPC world; learner 0 then waits (bounded) for its server process to exit."""
    try:
        client.leave()
    except Exception:
        pass  # the server is gone, or went as this learner left last: nothing is left to say to it
    shutdown_rpc()
    if process is not None:
        stop_server(process, timeout)

