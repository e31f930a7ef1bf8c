"""The RPC world's helpers that need no peer: the interface towards the rendezvous, the stderr filter, the
learner's words for a server that does not answer; and, with real processes, where a single-host run listens."""

import os
import random
import re
import socket
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
import torch.distributed.rpc as rpc

from lightning_rudra.core.protocol import ProtocolConfig
from lightning_rudra.learner.client import LearnerClient
from lightning_rudra.strategy.launchers.popen import PopenLauncher
from lightning_rudra.transport import rpc_world
from lightning_rudra.transport.rpc_world import address_towards, free_port, interface_towards, quiet_peers_leaving
from tests import rpc_harness as harness

PEER_LEFT = (
    b"[W1201 06:58:43.926196677 tensorpipe_agent.cpp:941] RPC agent for learner1 encountered error when "
    b"reading incoming response from server: EOF: end of file (this error originated at tensorpipe/transport"
    b"/uv/connection_impl.cc:132)\n"
)


def test_free_ports_are_never_ones_the_system_gives_outgoing_connections():
    # a port picked ahead of its run and bound later must not become some connection's source port meanwhile
    with open("/proc/sys/net/ipv4/ip_local_port_range") as file:
        low, high = (int(value) for value in file.read().split())
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    if low - 1024 >= 1000 or 65535 - high >= 1000:  # else the range leaves no room: the system's picks
        assert not any(low <= port <= high for port in ports), (low, high, ports)
    for port in ports[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_free_ports_neither_follow_nor_move_the_users_seeded_random(monkeypatch):
    random.seed(42)
    first = [free_port() for _ in range(3)]
    assert random.random() == random.Random(42).random()  # the user's stream did not move
    random.seed(42)
    assert not set(first) & {free_port() for _ in range(3)}  # two runs seeded alike pick apart


def test_with_no_room_outside_the_ephemeral_range_ports_are_the_systems_and_still_distinct(monkeypatch):
    monkeypatch.setattr(rpc_world, "_ports_outside_ephemeral_range", lambda: range(0))
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)


def test_the_learners_meet_on_a_port_picked_outside_the_ephemeral_range_only_where_lightning_would_pick(monkeypatch):
    from lightning_fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

    from lightning_rudra.strategy.launchers import pick_main_port

    for name in ("MASTER_PORT", "STANDALONE_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(rpc_world, "free_port", lambda: 23456)
    monkeypatch.setattr("lightning_rudra.strategy.launchers.free_port", lambda: 23456)
    pick_main_port(SLURMEnvironment())
    assert "MASTER_PORT" not in os.environ
    monkeypatch.setenv("STANDALONE_PORT", "29999")
    pick_main_port(LightningEnvironment())
    assert "MASTER_PORT" not in os.environ
    monkeypatch.delenv("STANDALONE_PORT")
    pick_main_port(LightningEnvironment())
    assert os.environ["MASTER_PORT"] == "23456" and LightningEnvironment().main_port == 23456
    monkeypatch.setenv("MASTER_PORT", "29500")  # the user's own stays
    pick_main_port(LightningEnvironment())
    assert os.environ["MASTER_PORT"] == "29500"


def test_the_interface_towards_the_rendezvous():
    assert address_towards("127.0.0.1") == "127.0.0.1" and interface_towards("127.0.0.1") == "lo"


def test_only_tensorpipes_peer_left_lines_are_dropped_while_leaving(capfd):
    with quiet_peers_leaving():
        os.write(2, PEER_LEFT)
        os.write(
            2,
            b"[W1201 06:58:43.1 tensorpipe_agent.cpp:620] RPC agent for server won't send response to "
            b"request #69 to learner1, as the agent is shutting down\n",
        )
        os.write(2, b"a warning of the user's own\n")
    os.write(2, PEER_LEFT)  # outside the context: passes
    assert capfd.readouterr().err == "a warning of the user's own\n" + PEER_LEFT.decode()


@pytest.mark.parametrize(
    "error, message",
    [
        (
            "RPCErr:1:RPC ran for more than set timeout (8000 ms) and will now be marked with an error",
            r"parameter server 1 \(on 10.0.0.2\) did not answer within 8 s \(rpc_timeout\): RPCErr",
        ),
        (
            "EOF: end of file (this error originated at tensorpipe/transport/uv/connection_impl.cc:132)",
            r"parameter server 1 \(on 10.0.0.2\) is gone: its connection closed \(EOF",
        ),
        (  # what the heartbeat saw in a CI run where a killed server's socket broke mid-write
            "EPIPE: broken pipe (this error originated at tensorpipe/transport/uv/connection_impl.cc:157)",
            r"parameter server 1 \(on 10.0.0.2\) is gone: its connection closed \(EPIPE",
        ),
    ],
)
def test_a_call_the_server_does_not_answer_names_it_and_its_host(error, message):
    """Whichever call fails first (a heartbeat, a push, the request for the next batches), the learner's error
    says which server did not answer, and where it runs. (No RPC world here: the heartbeat thread fails at
    once and ends.)"""
    client = LearnerClient(1, timeout=8.0, server_host="10.0.0.2", server=1)
    with pytest.raises(RuntimeError, match=message):
        with client._naming_a_lost_server():
            raise RuntimeError(error)
    assert re.search(message, client._lost(RuntimeError(error)) or ""), "the heartbeat says the same"


def listening(pid):
    """The (address, port) of every TCP socket process ``pid`` listens on, from /proc (IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            inodes.add(os.readlink(f"/proc/{pid}/fd/{fd}").removeprefix("socket:[").removesuffix("]"))
        except FileNotFoundError:  # closed meanwhile
            pass
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/{pid}/net/{table}") as lines:
            for fields in (line.split() for line in list(lines)[1:]):
                if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN
                    address, port = fields[1].split(":")
                    raw = bytes.fromhex(address)  # each 32-bit word in the kernel's (little-endian) order
                    found.append(
                        (
                            socket.inet_ntop(family, b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))),
                            int(port, 16),
                        )
                    )
    return found


def listeners(rank, clients, config):
    """Once the RPC world is up: what this learner and the server it started listen on."""
    return {
        "learner": listening(os.getpid()),
        "server": listening(rpc.rpc_sync(clients[0].server, os.getpid, timeout=10)),
    }


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_single_host_run_listens_on_loopback_only():
    """torch's TCPStore and RPC have no authentication and unpickle what they get: on one host, nothing of a run
    may be reachable from another machine."""
    [result] = harness.run_learners(1, listeners, config=ProtocolConfig(1, "async"))
    assert isinstance(result, dict), result
    assert len(result["server"]) >= 2, result  # at least the rendezvous' store and TensorPipe
    assert {address for side in result.values() for address, _ in side} == {"127.0.0.1"}, result


def test_lines_written_after_leaving_by_a_child_started_inside_never_reach_a_file_opened_since(
    tmp_path, capfd, monkeypatch
):
    """A learner restarted while the filter was open holds the pipe's write end: its lines come after the context
    ended, through the forwarder, and must reach stderr, not whatever file took the number of a closed descriptor."""
    monkeypatch.setattr("lightning_rudra.transport.rpc_world._FORWARDER_JOIN_S", 0.1)
    with quiet_peers_leaving():
        child = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read(); sys.stderr.write('a restarted learner says\\n')"],
            stdin=subprocess.PIPE,
        )
    with open(tmp_path / "checkpoint", "wb") as checkpoint:  # takes the lowest free descriptor number
        child.communicate(b"")  # now it writes, and ends
        forwarder = [t for t in threading.enumerate() if t.name == "rudra-stderr"]
        for thread in forwarder:
            thread.join(timeout=60)
        checkpoint.flush()
    assert child.returncode == 0 and not any(t.is_alive() for t in forwarder)
    assert (tmp_path / "checkpoint").read_bytes() == b""
    assert "a restarted learner says\n" in capfd.readouterr().err


def test_a_learner_restarted_while_leaving_neither_holds_the_leave_up_nor_writes_into_the_filter(tmp_path, capfd):
    """popen's launcher restarts a lost learner while learner 0 leaves (the filter open): the child must get the
    real stderr, not the filter's pipe, whose forwarder would then wait for the child's end (the leave held up for
    its whole bound) and, once this process exits, leave the child writing into a pipe nobody reads."""
    go = tmp_path / "go"
    script = (
        "import os, sys, time\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
        "sys.stderr.write('a restarted learner says\\n')\n"
    )
    launcher = SimpleNamespace(procs=[SimpleNamespace(args=[sys.executable, "-c", script])], _reported={0})
    before = set(threading.enumerate())
    with quiet_peers_leaving():
        [forwarder] = [t for t in threading.enumerate() if t.name == "rudra-stderr" and t not in before]
        PopenLauncher._restart(launcher, 0)
    child = launcher.procs[0]
    try:
        assert not forwarder.is_alive()  # the leave ended as soon as this process's own lines were passed on
        assert os.readlink(f"/proc/{child.pid}/fd/2") == os.readlink("/proc/self/fd/2")
    finally:
        go.touch()
        child.wait(timeout=60)
    assert child.returncode == 0 and launcher._reported == set()
    assert "a restarted learner says\n" in capfd.readouterr().err
