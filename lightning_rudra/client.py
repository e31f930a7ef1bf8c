"""The learner's side of the parameter server: starting it, joining its RPC world, push, pull and
collectives. Every call has a timeout; nothing here knows about Lightning."""

import errno
import os
import socket
import subprocess
import sys
import warnings
from typing import Any, Optional

import torch.distributed.rpc as rpc
from torch import Tensor

from lightning_rudra import server as _server
from lightning_rudra.protocol import OptimizerSpec, ProtocolConfig, Stats
from lightning_rudra.server import SERVER_NAME, learner_name


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


def init_rpc(name: str, rank: int, world_size: int, init_method: str, timeout: float) -> None:
    options = rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=timeout)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*gloo.*")  # torch's deprecation notice, printed by every init
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)


def shutdown_rpc(timeout: float) -> None:
    """Graceful when every peer is alive; bounded when one has died (the default would wait forever)."""
    try:
        rpc.shutdown(graceful=True, timeout=timeout)
    except Exception:
        try:
            rpc.shutdown(graceful=False)
        except RuntimeError:
            pass  # the failed graceful attempt already took the agent down


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
    command = [sys.executable, "-c", _SERVER_ENTRY.format(package=os.path.dirname(__file__)), "--init-method", init_method, "--learners",
               str(num_learners), "--timeout", str(timeout), "--parent-pid", str(os.getpid())]
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
             buffers: list[Tensor]) -> tuple[str, int, list[Tensor], list[Tensor]]:
        """Push a gradient computed from the weights last received; returns what became of it (status,
        staleness) and the weights to continue from."""
        status, staleness, params, new_buffers, self.timestamp = self._wait(
            "push", self.rank, optimizer, grads, has_grad, self.timestamp, hparams, buffers)
        return status, staleness, params, new_buffers

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
        pass  # the server is already gone: shutdown below is bounded either way
    shutdown_rpc(timeout)
    if process is not None:
        stop_server(process, timeout)

