"""The RPC world that learners and the server share: names, ports, joining and leaving.

Both sides import this module and nothing of each other's, so the server never depends on the client.
"""

import errno
import fcntl
import json
import os
import random
import re
import socket
import struct
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Optional

import torch.distributed as dist
import torch.distributed.rpc as rpc
import torch.distributed.rpc.constants as rpc_constants

SERVER_NAME = "server"


def server_name(server: int) -> str:
    return SERVER_NAME if server == 0 else f"{SERVER_NAME}{server}"


def learner_name(rank: int) -> str:
    return f"learner{rank}"


# ports free_port gave in this process: two learners' ports picked ahead of their runs must differ
_HANDED_PORTS: set[int] = set()
# its own generator: the global one is the user's (seeded: two runs would pick the same port) and must not move
_PICK = random.SystemRandom()


def free_port() -> int:
    """A port that nothing listens on now and that the system never gives an outgoing connection as its source
    port: the caller binds it later, and a port from the ephemeral range (what binding port 0 returns) can meanwhile
    become the source port of any connection on the machine, the learners' own included (EADDRINUSE in CI). Where
    the ephemeral range leaves no room, the system's pick; never a port given before in this process."""
    ports = _ports_outside_ephemeral_range()
    for attempt in range(1000):
        if ports and attempt < 100:
            port = _PICK.choice(ports)
        else:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("", 0))
                port = sock.getsockname()[1]
        if port not in _HANDED_PORTS and _can_bind(port):
            _HANDED_PORTS.add(port)
            return port
    raise RuntimeError("no free TCP port found in 1000 tries: is this machine out of ports?")


def _can_bind(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def _ports_outside_ephemeral_range() -> range:
    """Up to 12,000 ports just below the system's ephemeral range (Linux: 32768-60999, so 20768-32767), or above
    it; empty where the range leaves too little room."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as file:
            low, high = (int(value) for value in file.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    if low - 1024 >= 1000:
        return range(max(1024, low - 12000), low)
    if 65535 - high >= 1000:
        return range(high + 1, 65536)
    return range(0)


def port_from_agent_store(rank: int, host: str, port: int, timeout: float, key: str) -> int:
    """Under torchrun, its agent's TCP store already listens on host:port (MASTER_ADDR:MASTER_PORT), so the
    learners cannot meet there: learner 0 picks a free port on its host and publishes it in that store under
    ``key``, unless a port is published there already (a restarted learner 0 of an elastic run, whose servers
    outlived it), and the others read it from there (waiting up to ``timeout`` seconds for learner 0)."""
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
    if rank == 0:
        return int(store.compare_set(key, "", str(free_port())))
    return int(store.get(key))


def check_port_free(host: str, port: int) -> None:
    """The RPC rendezvous listens on host:port; say so plainly if something else already does."""
    _bound(host, port).close()


def _bound(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``port`` on the address of this machine that traffic to ``host`` leaves from:
    loopback when the learners meet at a loopback address (one host), else the interface towards them, which
    TensorPipe uses too. Never every interface: torch's stores and RPC have no authentication and unpickle what
    they get. An address that cannot be told (an IPv6 host) leaves the choice to the system, as torch does."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address_towards(host) or "", port))
    except OSError as error:
        sock.close()
        if error.errno != errno.EADDRINUSE:
            raise
        raise RuntimeError(
            f"port {port} on {host} is already in use, so the learners cannot meet there. Set MASTER_PORT to "
            "a free port (or unset it to let Lightning pick one), or stop the process that holds it."
        ) from error
    return sock


def rendezvous_store(host: str, port: int, timeout: float) -> dist.TCPStore:
    """The store of the rendezvous at host:port, listening on :func:`_bound`'s address only. torch's own would
    listen on every interface; made first, it is the one that ``rpc.init_rpc``'s multi-tenant store on the same
    port joins (or, with ``init_rpc(learner_store=True)``, that every process joins as a client). The store owns
    the socket from here on."""
    sock = _bound(host, port)
    sock.listen(socket.SOMAXCONN)
    return dist.TCPStore(
        host,
        port,
        is_master=True,
        timeout=timedelta(seconds=timeout),
        multi_tenant=True,
        master_listen_fd=sock.detach(),
    )


def rpc_counters() -> dict[str, Any]:
    """torch.distributed.rpc numbers, per process, its inits and its internal all-gathers (init and graceful
    shutdown use one each), and peers only meet when their numbers agree. A learner that already ran a stage
    (popen: fit, then test) is ahead of a new server process, which must start from the learners' numbers."""
    return {"init": rpc._init_counter, "all_gather": dict(rpc.api._all_gather_sequence_id)}


def set_rpc_counters(counters: dict[str, Any]) -> None:
    rpc._init_counter = counters["init"]
    rpc.api._all_gather_sequence_id.update(counters["all_gather"])


_COUNTERS_KEY = "lightning_rudra/rpc_counters"


def publish_rpc_counters(store: dist.Store) -> None:
    """Put this process's :func:`rpc_counters` in the rendezvous' store, for a server that no learner started."""
    store.set(_COUNTERS_KEY, json.dumps(rpc_counters()))


def withdraw_rpc_counters(store: dist.Store) -> None:
    store.delete_key(_COUNTERS_KEY)


def read_rpc_counters(host: str, port: int, timeout: float) -> dict[str, Any]:
    """The counters learner 0 published in the store of the rendezvous at host:port, waiting for it (its store, then
    the key) at most ``timeout`` seconds each; the error says who never came."""
    deadline = time.monotonic() + timeout
    try:
        while True:  # torch's client would log a C++ trace for every failed try: wait for the port quietly first
            try:
                socket.create_connection((host, port), timeout=1.0).close()
                break
            except OSError as refused:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nothing listens there: {refused}") from refused
                time.sleep(0.2)
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
        return json.loads(store.get(_COUNTERS_KEY))
    except (RuntimeError, dist.DistStoreError) as error:
        raise TimeoutError(
            f"learner 0 did not open the rendezvous at {host}:{port} within {timeout:g} s (rpc_timeout): are the "
            f"learner nodes running, with MASTER_ADDR={host} and MASTER_PORT={port}? ({error})"
        ) from error


def address_towards(host: str) -> Optional[str]:
    """This machine's IPv4 address that traffic to ``host`` leaves from, or None. No packet is sent: connecting
    a UDP socket only chooses the route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError:
        return None


def interface_towards(host: str) -> Optional[str]:
    """The name of this machine's network interface that traffic to ``host`` (IPv4) leaves from, or None."""
    address = address_towards(host)
    if address is None:
        return None
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as query:
            try:  # SIOCGIFADDR: the interface's IPv4 address
                packed = fcntl.ioctl(query.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == address:
            return name
    return None


@dataclass(frozen=True)
class StageWorld:
    """One stage's RPC world as every learner and server of it agrees on it: where it meets, who is in it, how long
    they wait. A learner builds it once per stage and hands it down unchanged (to :func:`init_rpc`, and to each
    server process it starts, which rebuilds it from its command line)."""

    host: str  # the rendezvous, where learner 0 (or the first server) listens
    port: int
    num_learners: int
    timeout: float  # rpc_timeout: every call that does not wait for other learners, and a silence before a loss
    started_by: tuple[Optional[int], ...] = (0,)  # per server, the learner that starts it (None: a server node)
    min_learners: Optional[int] = None  # elastic: training goes on while this many learners are left
    rejoin_wait: float = 0.0  # seconds lost learners have to rejoin when fewer than min_learners are left
    learner_store: bool = False  # the rendezvous' store is learner 0's (a run with server nodes, every stage)

    @property
    def init_method(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def num_servers(self) -> int:
        return len(self.started_by)

    @property
    def elastic(self) -> bool:
        """Processes may join later: a new process for a lost learner (``min_learners``)."""
        return self.min_learners is not None


def init_rpc(world: StageWorld, learner: Optional[int], server: int = 0, incarnation: int = 0) -> None:
    """Join ``world`` as learner number ``learner``, or as server ``server`` (``learner`` None). The first server is
    RPC rank 0, which hosts the rendezvous' TCP store: its port then closes when that server exits after the stage,
    and a new Trainer in learner 0's process can meet on the same port (torch keeps the store of a shut-down agent
    listening). A learner is rank ``learner + 1`` whatever the number of servers (those after the first come after
    the learners): torch fixes a process's rank for good at its first init. In an elastic world
    (:mod:`~lightning_rudra.transport.elastic`), a learner's process number ``incarnation`` > 0 (one that rejoins)
    has a name and rank of its own. With ``world.learner_store`` the rendezvous' store is learner 0's, made by it with
    :func:`rendezvous_store` before it joins (the servers run on server nodes, none on learner 0's host): every
    process, learner 0 too, joins that store as a client, and RPC rank 0 (the first server) hosts nothing.

    Args:
        world: the stage's world, the same in every process of it.
        learner: this learner's number; None for a server process.
        server: a server process's number (ignored for a learner).
        incarnation: a learner's process number in an elastic world (0: one of the first).
    """
    num_learners, num_servers, learner_store = world.num_learners, world.num_servers, world.learner_store
    if learner is not None:
        name, rank = learner_name(learner), learner + 1
        if incarnation:
            name, rank = f"{name}_{incarnation}", num_learners + num_servers + incarnation
    else:
        name, rank = server_name(server), 0 if server == 0 else num_learners + server
    # TensorPipe and the gloo group it makes at init advertise the address this machine's hostname resolves to,
    # which in containers and network namespaces is often not one the other hosts can reach: unless told
    # otherwise, use the interface that reaches the rendezvous. Under torchrun, TORCHELASTIC_USE_AGENT_STORE
    # makes every tcp:// rendezvous a client of torchrun's own store; ours is the server's (port_from_agent_store).
    interface = interface_towards(world.host)
    # torch's rendezvous makes every process a client of the store at host:port when this says "True"
    changes: dict[str, Optional[str]] = {"TORCHELASTIC_USE_AGENT_STORE": "True" if learner_store else None}
    if interface is not None:
        changes.update(
            {
                variable: interface
                for variable in ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
                if variable not in os.environ
            }
        )
    # "uv" (TCP): the shared-memory transport busy-polls, and idle waiting learners then starve the busy ones
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=world.init_method, rpc_timeout=world.timeout, _transports=["uv"]
    )
    store = rendezvous_store(world.host, world.port, world.timeout) if rank == 0 and not learner_store else None
    joining = _joining_within(world.timeout + JOIN_MARGIN_S, learner_store)
    with environment(changes), warnings.catch_warnings(), joining:
        warnings.filterwarnings("ignore", message=".*gloo.*")  # torch's deprecation notice, printed by every init
        world_size = None if world.elastic else num_learners + num_servers
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    del store  # needed only until the RPC agent's own store joined its listener, which that store now keeps


JOIN_MARGIN_S = 60.0  # beyond rpc_timeout, for the processes of a static world to start (a popen learner imports)


@contextmanager
def _joining_within(seconds: float, bounded: bool) -> Iterator[None]:
    """torch waits for every process of a static RPC world in a gloo group whose timeout is 24 days, unbounded in
    practice. Where processes start on other machines by hand (server nodes: ``bounded``) the wait ends after
    ``seconds`` instead. The constant is read when the group is made; the group serves only the init."""
    if not bounded:
        yield
        return
    before = rpc_constants.DEFAULT_PROCESS_GROUP_TIMEOUT
    rpc_constants.DEFAULT_PROCESS_GROUP_TIMEOUT = timedelta(seconds=seconds)
    try:
        yield
    finally:
        rpc_constants.DEFAULT_PROCESS_GROUP_TIMEOUT = before


@contextmanager
def environment(changes: dict[str, Optional[str]]) -> Iterator[None]:
    """Environment variables set (None: removed) while the context is open, as they were afterwards."""
    before = {variable: os.environ.get(variable) for variable in changes}
    try:
        _set_environment(changes)
        yield
    finally:
        _set_environment(before)


def _set_environment(values: dict[str, Optional[str]]) -> None:
    for variable, value in values.items():
        if value is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = value


# What TensorPipe logs (C++, to fd 2) in a process whose peer closes a connection while its own agent runs, and
# in the server when it shuts down with a reply to a learner that has left still unsent
_PEER_LEFT = re.compile(
    rb"tensorpipe_agent\.cpp:\d+\] RPC agent for \S+ (encountered error when (reading incoming "
    rb"(request|response) from|sending response to request #\d+ to) \S+: (pipe closed|EOF: end "
    rb"of file)|won't send response to request #\d+ to \S+, as the agent is shutting down)"
)


_FORWARDER_JOIN_S = 5.0  # how long leaving waits for the lines written before it to be passed on
# while quiet_peers_leaving is open: (the real stderr, the filter pipe's write end), for real_stderr
_filtering: Optional[tuple[int, int]] = None
_filtering_lock = threading.Lock()


@contextmanager
def quiet_peers_leaving() -> Iterator[None]:
    """Drops TensorPipe's warnings about a peer that closed its connection from this process's stderr while the
    context is open; every other line passes unchanged. At the end of every run each process sees the others
    leave, and torch only keeps quiet about it in a graceful shutdown (which :func:`shutdown_rpc` cannot use).
    The lines are C++ writes to file descriptor 2, so the filter sits there, and only around the leaving."""
    sys.stderr.flush()
    try:
        original = os.dup(2)
    except OSError:  # no stderr to filter (closed by a daemon's launcher)
        yield
        return
    global _filtering
    read_end, write_end = os.pipe()
    with _filtering_lock:
        os.dup2(write_end, 2)
        outer, _filtering = _filtering, (original if _filtering is None else _filtering[0], write_end)

    def forward() -> None:
        try:
            with os.fdopen(read_end, "rb") as lines:
                for line in lines:
                    if not _PEER_LEFT.search(line):
                        os.write(original, line)
        finally:  # only here: closed sooner, its number could go to a file that would then get these lines
            os.close(original)

    forwarder = threading.Thread(target=forward, name="rudra-stderr", daemon=True)
    forwarder.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        # closes this process's write ends of the pipe: the forwarder reads what is left, then ends (a child started
        # meanwhile got the real stderr: real_stderr)
        with _filtering_lock:
            os.dup2(original, 2)
            os.close(write_end)
            _filtering = outer
        forwarder.join(timeout=_FORWARDER_JOIN_S)


@contextmanager
def real_stderr() -> Iterator[None]:
    """File descriptor 2 is the real stderr while the context is open, also inside :func:`quiet_peers_leaving`:
    a child process started here (a learner restarted during a leave) inherits it, not the filter's pipe, which
    would hold the leave up until the child ends and leave the child writing into a pipe nobody reads once this
    process has exited. TensorPipe's lines of that moment pass unfiltered."""
    with _filtering_lock:
        if _filtering is None:
            yield
            return
        real, pipe = _filtering
        os.dup2(real, 2)
        try:
            yield
        finally:
            os.dup2(pipe, 2)


def shutdown_rpc() -> None:
    """Leave the RPC world at once. Not torch's graceful shutdown: that is a barrier numbered by a process-wide
    C++ counter, so a learner's second stage would wait out the timeout for a new server that counts from 0.
    Callers meet through the server first (the learners' last gather, then every learner's ``leave``)."""
    rpc.shutdown(graceful=False)
