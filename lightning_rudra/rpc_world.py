"""The RPC world that learners and the server share: names, ports, joining and leaving.

Both sides import this module and nothing of each other's, so the server never depends on the client.
"""

import errno
import socket
import warnings
from typing import Any, Optional

import torch.distributed.rpc as rpc

SERVER_NAME = "server"


def learner_name(rank: int) -> str:
    return f"learner{rank}"


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


def init_rpc(learner: Optional[int], num_learners: int, init_method: str, timeout: float) -> None:
    """Join as learner number ``learner``, or as the server (None). The server is RPC rank 0, which hosts the
    rendezvous' TCP store: its port then closes when the server exits after the stage, and a new Trainer in
    learner 0's process can meet on the same port (torch keeps the store of a shut-down agent listening)."""
    name, rank = (SERVER_NAME, 0) if learner is None else (learner_name(learner), learner + 1)
    # "uv" (TCP): the shared-memory transport busy-polls, and idle waiting learners then starve the busy ones
    options = rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=timeout, _transports=["uv"])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*gloo.*")  # torch's deprecation notice, printed by every init
        rpc.init_rpc(name, rank=rank, world_size=num_learners + 1, rpc_backend_options=options)


def shutdown_rpc() -> None:
    """Leave the RPC world at once. Not torch's graceful shutdown: that is a barrier numbered by a process-wide
    C++ counter, so a learner's second stage would wait out the timeout for a new server that counts from 0.
    Callers meet through the server first (the learners' last gather, then every learner's ``leave``)."""
    rpc.shutdown(graceful=False)
