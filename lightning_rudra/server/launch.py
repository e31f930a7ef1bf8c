"""How a learner starts a server process and waits for its end, and the command line that carries the stage's
world to it (:class:`~lightning_rudra.transport.rpc_world.StageWorld`): the process itself is
:mod:`lightning_rudra.server.process`."""

import argparse
import json
import os
import subprocess
import sys
import logging
from typing import Optional, Union

from lightning_rudra.server.forked_server import STARTER_ENV, ForkedServer, fork_server
from lightning_rudra.transport.logs import check_switches
from lightning_rudra.transport.rpc_world import StageWorld, rpc_counters

log = logging.getLogger(__name__)

ServerProcess = Union[subprocess.Popen, ForkedServer]  # a fresh interpreter, or forked by the server starter

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Not `python -m`: the RPC handlers must live in the module `lightning_rudra.server.process`, not in a copy named
# __main__. The package is entered without running its __init__, which imports Lightning (seconds), until a
# module of the user's that the server imports (one that defines an optimizer) asks for the public API.
_SERVER_ENTRY = """import os, sys, threading, types
package = types.ModuleType("lightning_rudra")
package.__path__ = [{package!r}]
lock = threading.Lock()  # RPC threads may ask at once, and torch's lazy imports are not thread-safe
def __getattr__(name):
    if name.startswith("__"):  # the import machinery probing (__file__, __spec__...): not the public API
        raise AttributeError(name)
    with lock:
        if "__all__" not in package.__dict__:
            init = os.path.join({package!r}, "__init__.py")
            exec(compile(open(init).read(), init, "exec"), package.__dict__)
    if name not in package.__dict__:
        raise AttributeError(name)
    return package.__dict__[name]
package.__getattr__ = __getattr__
sys.modules["lightning_rudra"] = package
from lightning_rudra.server.process import main
main()
# main has released what the server held and left RPC: skip the interpreter's teardown of torch (one to two seconds
# here), which the learner that started this process waits for at the end of every stage
import logging
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)"""


def start_server(
    world: StageWorld, server: int, code: Optional[str] = None, server_node: bool = False
) -> ServerProcess:
    """Start the process of server ``server`` of ``world``. It exits when every learner has left or is lost.
    Outside an elastic world it also exits at once if this process dies; in one (``world.min_learners``), it
    outlives this process (in a session of its own, so that what ends this learner's process group, a terminal's
    Ctrl-C or torchrun restarting its workers, does not end it): a new process for this learner rejoins it.
    Where this process's environment names a server starter (``start_method="forkserver"``), the starter forks it;
    otherwise it is a fresh interpreter.

    Args:
        world: the stage's world, as the learners agree on it (the server rebuilds it from its command line).
        server: which of the world's servers this is.
        code: the Python the process runs, if not the server's own entry (benchmarks' patched servers).
        server_node: started by a server node's process, not a learner: the server takes the RPC counters from
            learner 0's store of the rendezvous, and joins that store as a client, as every server does with
            ``world.learner_store`` (a run with server nodes, every stage).
    """
    check_switches()
    argv = command_line(world, server, server_node)
    starter = os.environ.get(STARTER_ENV)
    if starter and code is None:
        try:
            return fork_server(starter, argv, new_session=world.elastic, timeout=world.timeout)
        except OSError as error:  # the process that owns the starter is ending, or ended: a fresh interpreter
            log.warning(
                "the server starter in %s did not answer (%s): server %d starts in a new process",
                starter,
                error,
                server,
            )
    env = dict(os.environ)
    # the server must import whatever the learner's optimizers are made of
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd()] + [p for p in sys.path if p])
    command = [sys.executable, "-c", code or _SERVER_ENTRY.format(package=_PACKAGE), *argv]
    return subprocess.Popen(command, env=env, start_new_session=world.elastic)


def command_line(world: StageWorld, server: int, server_node: bool = False) -> list[str]:
    """The arguments that carry ``world`` to server ``server`` (:func:`read_command_line` reads them)."""
    argv = [
        "--init-method",
        world.init_method,
        "--rpc-counters",
        json.dumps(rpc_counters()),
        "--learners",
        str(world.num_learners),
        "--timeout",
        str(world.timeout),
        "--parent-pid",
        str(os.getpid()),
        "--server",
        str(server),
        "--started-by",
        json.dumps(list(world.started_by)),
    ]
    if server_node or world.learner_store:
        argv += ["--server-node" if server_node else "--learner-store"]
    if world.elastic:
        argv += ["--min-learners", str(world.min_learners), "--rejoin-wait", str(world.rejoin_wait)]
    return argv


NO_LEARNERS = 2  # a server node's server's exit code when learner 0 never opened the rendezvous
RUN_FAILED = 4  # a server node's server's exit code when training failed (a learner lost or raised)


def stop_server(process: ServerProcess, timeout: float) -> None:
    """Wait up to ``timeout`` for ``process`` to end, then kill it and wait as long again (a forked server's end is
    told by its starter, which may itself be stopped: then it is left to it)."""
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("server process %d did not end within %g s of being killed", process.pid, timeout)


def read_command_line(argv: Optional[list[str]]) -> argparse.Namespace:
    """What :func:`start_server` wrote on the command line, and ``world``, the stage's world rebuilt from it."""
    parser = argparse.ArgumentParser(description="lightning_rudra parameter server (started by RudraStrategy)")
    parser.add_argument("--init-method", required=True, help="tcp://host:port of the learners' RPC rendezvous")
    parser.add_argument("--rpc-counters", type=json.loads, required=True, help="see rpc_world.rpc_counters")
    parser.add_argument("--learners", type=int, required=True)
    parser.add_argument(
        "--timeout",
        type=float,
        required=True,
        help="seconds, for every RPC call that does not wait for other learners, and for a "
        "learner's silence before it counts as lost",
    )
    parser.add_argument(
        "--min-learners",
        type=int,
        default=None,
        help="train on while this many learners are left (default: a lost learner ends training)",
    )
    parser.add_argument(
        "--rejoin-wait",
        type=float,
        default=0.0,
        help="seconds lost learners have to rejoin when fewer than min_learners are left (0: training ends)",
    )
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument(
        "--parent-fd",
        type=int,
        default=None,
        help="forked by the server starter: a pipe that ends when the learner does",
    )
    parser.add_argument("--server", type=int, default=0, help="which of the server processes this is")
    parser.add_argument(
        "--started-by",
        type=json.loads,
        default=[0],
        help="per server, the learner whose process started it",
    )
    parser.add_argument(
        "--server-node",
        action="store_true",
        help="started by a server node: join learner 0's store of the rendezvous, which has the RPC counters",
    )
    parser.add_argument("--learner-store", action="store_true", help="join learner 0's store of the rendezvous")
    args = parser.parse_args(argv)
    args.world = _world(args)
    return args


def _world(args: argparse.Namespace) -> StageWorld:
    host, _, port = args.init_method.removeprefix("tcp://").rpartition(":")
    learner_store = args.server_node or args.learner_store
    started_by = tuple(args.started_by)
    return StageWorld(
        host, int(port), args.learners, args.timeout, started_by, args.min_learners, args.rejoin_wait, learner_store
    )
