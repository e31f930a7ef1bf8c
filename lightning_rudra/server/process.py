"""The parameter server process: a :class:`~lightning_rudra.server.parameter_server.ParameterServer` behind
torch.distributed.rpc. Handlers never block an RPC thread: a call that must wait returns the server's future from an
``@rpc.functions.async_execution`` function. A learner starts it with
:func:`~lightning_rudra.server.launch.start_server`.
"""

import argparse
import dataclasses
import inspect
import json
import logging
import os
import secrets
import select
import sys
import threading
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from lightning_rudra.core.compression import COMPRESSIONS, WeightDeltas
from lightning_rudra.core.update import Push, PushReply
from lightning_rudra.server.launch import NO_LEARNERS, RUN_FAILED, read_command_line
from lightning_rudra.server.parameter_server import ParameterServer
from lightning_rudra.transport.elastic import RunStore, TokenWatch, forget, job_id
from lightning_rudra.transport.frames import FrameLimits
from lightning_rudra.transport.logs import log_to_stderr
from lightning_rudra.transport.stream import StreamOffer
from lightning_rudra.transport.stream_server import StreamServer
from lightning_rudra.transport.rpc_world import (
    StageWorld,
    address_towards,
    init_rpc,
    quiet_peers_leaving,
    server_name,
    read_rpc_counters,
    set_rpc_counters,
    shutdown_rpc,
)

log = logging.getLogger(__name__)

# The RPC entry points run in the server process, on its one ParameterServer.
_server: Optional[ParameterServer] = None


# What a learner may call, and the name of the parameter that holds the calling learner (None: no learner argument;
# a push's learner is its Push's)
ENTRY_POINTS: dict[str, Optional[str]] = {
    "register": None,
    "attach": "learner",
    "attached": "learner",
    "pull": None,
    "push": "push",
    "push_deltas": "push",
    "stream_address": None,
    "finish": "learner",
    "gather": "learner",
    "draw": "learner",
    "stop_drawing": "learner",
    "heartbeat": "learner",
    "leave": "learner",
    "report": "reporter",
    "rejoin": "learner",
    "progress": "learner",
    "stats": None,
    "snapshot": None,
    "optimizer_state": None,
    "load_optimizer_state": None,
    "round_norm": None,  # from another server: its part of a hardsync round's gradient norm (clipping by norm)
}


def _entry(method: str, args: tuple) -> Callable:
    """The server's method for a call from a learner, once the call is checked: nothing changes before."""
    if method not in ENTRY_POINTS:
        raise ValueError(
            f"{method!r} is not a call the parameter server answers: expected one of {', '.join(sorted(ENTRY_POINTS))}"
        )
    assert _server is not None  # main sets it before it joins the RPC world that brings calls
    answer = _HERE[method] if method in _HERE else getattr(_server, method)
    name = ENTRY_POINTS[method]
    if name is not None:
        value = _argument(method, answer, name, args)
        if isinstance(value, Push) and not _whole(value):
            raise TypeError(
                f"{method} refused: its Push lacks fields (a learner of another version of lightning_rudra?)"
            )
        learner = value.learner if isinstance(value, Push) else value
        _server.check_caller(method.removesuffix("_deltas"), learner)
        if name == "push" and not isinstance(value, Push):
            raise TypeError(
                f"{method} from learner {learner} refused: it carries {type(value).__name__} {value!r}, not a "
                "lightning_rudra.core.update.Push (a learner of another version of lightning_rudra?)"
            )
    return answer


def _argument(method: str, answer: Callable, name: str, args: tuple) -> Any:
    """The argument ``name`` of a call to ``answer`` with ``args`` (None if it is missing: the check refuses a call
    that names no learner); a call with more arguments than ``answer`` takes is refused."""
    signature = inspect.signature(answer)
    try:
        return signature.bind_partial(*args).arguments.get(name)
    except TypeError as error:
        raise TypeError(
            f"{method} refused: {len(args)} arguments do not fit {method}{signature} ({error}; a learner of another "
            "version of lightning_rudra?)"
        ) from None


def _whole(push: Push) -> bool:
    """Unpickling sets a dataclass's fields without its constructor, and may leave some out."""
    return all(hasattr(push, field.name) for field in dataclasses.fields(Push))


def _push_deltas(compression: str, count: int, push: Push) -> Future:
    """A push whose reply's weights travel as differences from the weights the learner holds, after ``count``
    replies (:meth:`LearnerClient.weights_as_deltas <lightning_rudra.learner.client.LearnerClient.weights_as_deltas>`).

    Args:
        compression: the wire dtype of the differences (``"bf16"``).
        count: the replies the learner will have applied when this one comes.
        push: the learner's gradient.

    Returns:
        the future of the :class:`PushReply`, its weights as differences.
    """
    assert _server is not None
    server, learner = _server, push.learner
    if not isinstance(compression, str) or compression not in COMPRESSIONS:
        raise ValueError(
            f"push_deltas from learner {learner} refused: compression={compression!r} is not one the server knows: "
            f"expected one of {', '.join(map(repr, COMPRESSIONS))} (a learner of another version of lightning_rudra?)"
        )
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(
            f"push_deltas from learner {learner} refused: count={count!r} is not valid: expected the number of "
            "replies the learner has applied, an int >= 0 (0: it holds no weights yet)."
        )
    pushed = server.push(push)  # a refused push raises here: no copy of the learner's weights is made for it
    with server.lock:  # where a loss or a leave forgets the copies
        deltas = server.weight_deltas.setdefault(compression, WeightDeltas(compression))
    # a new process of the learner holds nothing yet: it sends count 0 and gets the whole weights
    key = int(learner)

    def encoded(replied: Future) -> Any:
        reply = replied.value()
        if isinstance(reply, PushReply) and reply.params is not None:
            return reply._replace(params=deltas.encode(key, count, reply.params))  # type: ignore[arg-type]  # decoded by the learner
        return reply  # a failed wait arrives as a value: the learner raises it

    return pushed.then(encoded)


# pushes over a connection of their own (transport.stream): opened when the first learner asks (stream_address)
_stream: Optional[StreamServer] = None
_stream_lock = threading.Lock()
STREAMED = ("push", "push_deltas")  # the only calls the stream takes: everything else goes through RPC


def _stream_address() -> Optional[StreamOffer]:
    """Where this server takes pushes over a connection of their own, with the secret that proves a connection
    belongs to the run (only RPC hands it out), opened at the first call: a learner asks, once the model is
    registered. None where this host's address towards the learners is not known (an IPv6 rendezvous):
    pushes then go through RPC, and no port listens on every interface."""
    assert _server is not None
    with _stream_lock:
        global _stream
        if _stream is None and _server.address is not None:
            core = _server._protocol()  # the frames' limit is the model's size
            model_bytes = sum(t.numel() * t.element_size() for t in core.flat_params + core.flat_buffers)
            _stream = StreamServer(
                _server.address,
                _stream_call,
                secrets.token_bytes(32),
                FrameLimits.for_model(model_bytes),
                _server.membership.timeout,
                max_peers=2 * _server.num_learners,  # a learner's process, and a lost one's not yet closed
            )
        return None if _stream is None else _stream.offer()


def _stream_call(method: str, args: tuple) -> Any:
    if method not in STREAMED:
        raise ValueError(
            f"{method!r} is not a call the stream takes: only {' and '.join(STREAMED)}; the rest go by RPC"
        )
    return _entry(method, args)(*args)


_HERE: dict[str, Callable] = {"push_deltas": _push_deltas, "stream_address": _stream_address}  # answered here


def call(method: str, *args: Any) -> Any:
    """The server's wire API: a learner calls ``rpc_sync``/``rpc_async(server, call, args=(method, *args))`` for
    one of ``ENTRY_POINTS``, answered when the method returns."""
    return _entry(method, args)(*args)


@rpc.functions.async_execution
def call_async(method: str, *args: Any) -> Future:
    """As :func:`call`, for the methods that answer with a future (a push, a collective, the end of training):
    the server's thread is free while they wait."""
    return _entry(method, args)(*args)  # raising here, before any future, reaches the caller


def _send_norm(timeout: float, to: int, optimizer: int, round: int, partial: float) -> None:
    """This server's part of a hardsync round's gradient norm, to server ``to``
    (:meth:`~lightning_rudra.server.model_server.ModelServer.round_norm`): not waited for; if it does not arrive
    within ``timeout`` (that server died), training cannot go on, and this server's waits fail with why."""
    assert _server is not None
    server = _server
    args = ("round_norm", server.server, optimizer, round, partial)
    try:
        sent = rpc.rpc_async(server_name(to), call, args=args, timeout=timeout)
    except Exception as error:  # the RPC agent is gone, or does not know the name
        server.norm_not_sent(to, error)
        return

    def delivered(done: Future) -> None:
        try:
            done.wait()
        except Exception as error:
            server.norm_not_sent(to, error)

    sent.add_done_callback(delivered)


def _exit_when_orphaned(parent_pid: int, parent_fd: Optional[int]) -> None:
    """The learner that started this server died: nobody will ever ask us to stop. Forked by the server starter,
    the learner is not our parent: the pipe it holds open (``parent_fd``) ends when it dies."""
    if parent_fd is not None:
        _wait_for_learner_end(parent_pid, parent_fd)
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    _release_shared_memory()
    os._exit(3)


def _wait_for_learner_end(parent_pid: int, parent_fd: int) -> None:
    """Returns when the learner has ended: its pipe ends, or, as a process the learner forked (a DataLoader worker)
    holds the pipe's write end too, the learner's process does (a pidfd, where the kernel has them)."""
    watched = [parent_fd]
    try:
        watched.append(os.pidfd_open(parent_pid))
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd: the pipe alone
        pass
    while True:
        ready, _, _ = select.select(watched, [], [])
        if parent_fd not in ready or not os.read(parent_fd, 1):
            return


def _exit_unless_confirmed(parent_fd: int) -> None:
    """An elastic world's server forked by the server starter outlives its learner, but only once that learner has
    it (one byte on the pipe): a learner that gave up waiting for the starter's answer, and started a fresh
    interpreter instead, closed the pipe first."""
    if not os.read(parent_fd, 1):
        _release_shared_memory()
        os._exit(3)
    os.close(parent_fd)


def _open_to_rejoins(world: StageWorld, server: int, rpc_counters: dict[str, Any]) -> None:
    """An elastic world (``min_learners``): the first server keeps the run's keys in the store, strikes each lost
    learner from the RPC world's members (:mod:`lightning_rudra.transport.elastic`) and frees a group token that a
    failed join left held. Every server then waits for the first members to have joined."""
    store = RunStore(world.host, world.port, world.timeout)
    assert _server is not None
    if server == 0:
        store.publish("rpc_counters", rpc_counters)
        store.publish("job", job_id())

        def lost(learner: int, why: str) -> None:
            try:  # marked first: striking its names may wait for the group token (a new process strikes them too)
                store.mark(learner, "lost", why)
                forget(learner)
            except Exception as error:  # the store closes as the run ends
                log.warning("learner %d could not be struck from the RPC world: %s", learner, error)

        _server.on_lost = lost
        _server.on_heard = lambda learner, process: store.mark(learner, "alive", json.dumps(process))
        threading.Thread(target=_free_stuck_tokens, daemon=True).start()
    store.arrive(world.num_learners + world.num_servers)


def _free_stuck_tokens() -> None:
    watch = TokenWatch()
    assert _server is not None
    while not _server.all_left.wait(1.0):
        try:
            holder = watch.check()
        except Exception:  # the agent is shutting down
            return
        if holder is not None:
            log.warning("a process failed while it joined (%s): the RPC world is open again", holder)


def _release_shared_memory() -> None:
    if _server is not None:
        _server.shared.release()


def _counters(args: argparse.Namespace) -> dict[str, Any]:
    """The RPC counters this server starts from: a server node's from learner 0's store (it exits, early, when
    the learners never come), any other's from the learner that started it."""
    world = args.world
    try:
        return read_rpc_counters(world.host, world.port, world.timeout) if args.server_node else args.rpc_counters
    except TimeoutError as error:
        log.error("parameter server %d: %s", args.server, error)
        sys.exit(NO_LEARNERS)


def _make_server(world: StageWorld, server: int) -> ParameterServer:
    """This process's one :class:`ParameterServer`, which the RPC entry points serve."""
    made = ParameterServer(
        world.num_learners,
        world.timeout,
        world.min_learners,
        announce=server == 0,
        rejoin_wait=world.rejoin_wait,
        name=f"parameter server {server}",
        server=server,
    )
    made.send_norm = lambda *norm: _send_norm(world.timeout, *norm)
    made.address = address_towards(world.host)
    return made


def main(argv: Optional[list[str]] = None) -> None:
    args = read_command_line(argv)
    world: StageWorld = args.world
    log_to_stderr()  # this process has no logging of its own: what it has to say goes to its stderr
    counters = _counters(args)
    torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // 2)))
    # torch imports its compiler stack (some 800 modules: seconds, over 10 s on a busy machine) when it builds its
    # first optimizer: here, before the learners can call, not in learner 0's register call, which has rpc_timeout
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])
    if not world.elastic:  # an elastic run's servers outlive the learners that started them
        threading.Thread(target=_exit_when_orphaned, args=(args.parent_pid, args.parent_fd), daemon=True).start()
    elif args.parent_fd is not None:
        threading.Thread(target=_exit_unless_confirmed, args=(args.parent_fd,), daemon=True).start()
    global _server
    _server = _make_server(world, args.server)
    set_rpc_counters(counters)
    init_rpc(world, None, args.server)
    if world.elastic:
        _open_to_rejoins(world, args.server, args.rpc_counters)
    _server.membership.all_joined()
    threading.Thread(target=_server.watch, daemon=True).start()
    # Learners leave at the end of every Trainer stage, or are lost; without min_learners, if the learner that
    # started this server dies, _exit_when_orphaned ends it.
    with quiet_peers_leaving():
        try:
            _server.all_left.wait()
        finally:
            _release_shared_memory()
        shutdown_rpc()
    if args.server_node and _server.failure is not None:  # the server node's fit raises with this
        log.error("parameter server %d: %s", args.server, _server.failure)
        sys.exit(RUN_FAILED)
