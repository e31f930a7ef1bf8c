"""The server starter (``start_method="forkserver"``): it forks a server only for a peer that has its key, reads
nothing but a bounded JSON request, never waits on one peer for long, and leaves no process behind: a forked server
ends with its learner, and the starter with the process that owns it. Real processes; the training runs through it
are the RPC and Trainer tests'."""

import hmac
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch.multiprocessing as mp

from lightning_rudra.server import launch
from lightning_rudra.server.forked_server import STARTER_ENV, fork_server
from lightning_rudra.server.starter import SERVER_STARTER, forked_servers
from lightning_rudra.transport.rpc_world import StageWorld, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def folder():
    return SERVER_STARTER.ensure_running()


def _waiting_world(timeout: float = 300.0) -> StageWorld:
    """A world whose learners never come: its server waits in the rendezvous (``timeout`` seconds)."""
    return StageWorld("127.0.0.1", free_port(), 1, timeout, (0,))


def _children(pid: int) -> set[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return {int(child) for child in f.read().split()}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _shown(pid: int) -> str:
    """What ps shows of ``pid``, once it shows a server (its first milliseconds, the fork server's command line)."""
    deadline = time.monotonic() + 30
    while True:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            shown = f.read().replace(b"\0", b" ").decode()
        if "lightning_rudra.server.process --init-method " in shown or time.monotonic() > deadline:
            return shown
        time.sleep(0.05)


def _raw_request(folder: str, key: bytes, request: bytes, fds=(1, 2, 1)) -> bytes:
    """What the starter answers a hand-made request: the 4 bytes of its pid (0: refused), or less if it hung up."""
    with socket.socket(socket.AF_UNIX) as connection:
        connection.settimeout(30)
        connection.connect(os.path.join(folder, "socket"))
        challenge = connection.recv(32)
        socket.send_fds(connection, [hmac.digest(key, challenge, "sha256") + len(request).to_bytes(4, "big")], fds)
        try:
            connection.sendall(request)
        except (BrokenPipeError, ConnectionResetError):  # refused, and closed, before it read the request
            pass
        try:
            return connection.recv(4)
        except ConnectionResetError:
            return b""


def test_a_forked_server_has_the_learners_stderr_and_its_exit_code_comes_back(folder, capfd):
    server = fork_server(folder, ["--no-such-option"], new_session=False, timeout=30)
    assert server.wait(timeout=60) == 2  # argparse's exit code, as for a fresh interpreter
    assert "the following arguments are required: --init-method" in capfd.readouterr().err


def test_a_forked_server_waits_kills_and_runs_in_a_session_of_its_own_when_asked(folder):
    argv = launch.command_line(_waiting_world(), 0)
    for new_session in (False, True):
        server = fork_server(folder, argv, new_session=new_session, timeout=30)
        assert server.pid in _children(SERVER_STARTER.pid)
        assert forked_servers(folder)[server.pid] == argv  # what a fresh server's command line would say
        with pytest.raises(subprocess.TimeoutExpired):
            server.wait(timeout=0.2)
        assert server.poll() is None
        assert (os.getsid(server.pid) == server.pid) is new_session
        assert " --server 0 " in _shown(server.pid)  # test_faults finds a server by it
        server.kill()
        assert server.wait(timeout=60) == -9 and server.poll() == -9
        assert server.pid not in forked_servers(folder)


def test_requests_without_the_key_or_malformed_are_refused_and_the_starter_serves_on(folder):
    before = _children(SERVER_STARTER.pid)
    with open(os.path.join(folder, "key"), "rb") as f:
        key = f.read()
    request = json.dumps({"argv": [], "env": {}, "cwd": "/", "path": [], "new_session": False}).encode()
    assert _raw_request(folder, b"not the key", request) in (b"\0\0\0\0", b"")
    for bad in (b"not json", json.dumps({"argv": "a string"}).encode(), json.dumps([1, 2]).encode()):
        assert _raw_request(folder, key, bad) == b"\0\0\0\0"
    wrong_types = json.dumps({"argv": [1], "env": {}, "cwd": "/", "path": [], "new_session": False}).encode()
    assert _raw_request(folder, key, wrong_types) == b"\0\0\0\0"
    assert _raw_request(folder, key, request, fds=(1,)) == b"\0\0\0\0"  # without its descriptors
    assert not _children(SERVER_STARTER.pid) - before  # nothing forked (an earlier test's servers may be ending)
    assert fork_server(folder, ["--no-such-option"], new_session=False, timeout=30).wait(timeout=60) == 2


def test_a_silent_peer_holds_the_starter_for_seconds_not_for_ever(folder):
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(os.path.join(folder, "socket"))
    answered = []
    thread = threading.Thread(
        target=lambda: answered.append(fork_server(folder, ["--no-such-option"], False, timeout=60).wait(60))
    )
    thread.start()
    silent.settimeout(60)
    assert silent.recv(32) and silent.recv(4) == b"\0\0\0\0"  # its challenge, then refused once it timed out
    thread.join(timeout=90)
    assert answered == [2]
    silent.close()


def test_a_peer_that_trickles_its_bytes_holds_the_starter_for_the_handshake_bound_in_all(folder):
    with socket.socket(socket.AF_UNIX) as slow:
        slow.connect(os.path.join(folder, "socket"))
        slow.settimeout(60)
        slow.recv(32)
        start = time.monotonic()
        answer = b""
        for _ in range(35):  # a byte every 2 s: each read of the starter's is answered before its 5 s
            try:
                slow.send(b"x")
            except OSError:
                break
            answer = slow.recv(4) if select_readable(slow, 2.0) else b""
            if answer:
                break
        assert answer == b"\0\0\0\0" and time.monotonic() - start < 9


def select_readable(connection: socket.socket, timeout: float) -> bool:
    import select

    return bool(select.select([connection], [], [], timeout)[0])


def test_what_a_peer_sends_never_ends_the_starter(folder):
    with open(os.path.join(folder, "key"), "rb") as f:
        key = f.read()
    assert _raw_request(folder, key, b"[" * 100_000 + b"]" * 100_000) == b"\0\0\0\0"  # RecursionError in json
    os.kill(SERVER_STARTER.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole process group
    assert fork_server(folder, ["--no-such-option"], new_session=False, timeout=30).wait(timeout=60) == 2


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace injects the failure of fork")
def test_a_fork_that_fails_refuses_that_request_and_the_servers_running_run_on(folder):
    running = fork_server(folder, launch.command_line(_waiting_world(), 0), new_session=False, timeout=30)
    strace = subprocess.Popen(
        ["strace", "-qq", "-o", os.devnull, "-p", str(SERVER_STARTER.pid), "-e", "trace=clone,clone3"]
        + ["-e", "inject=clone,clone3:error=EAGAIN"]
    )
    try:
        time.sleep(2)  # attached
        with pytest.raises(ConnectionRefusedError):
            fork_server(folder, ["--no-such-option"], new_session=False, timeout=30)
    finally:
        strace.terminate()
        strace.wait()
    assert running.poll() is None
    running.kill()
    assert running.wait(timeout=60) == -9


def test_an_elastic_server_whose_learner_gave_up_before_it_had_its_pid_exits(folder):
    """The learner fell back to a fresh interpreter (its wait for the pid timed out): no second server 0 runs on."""
    with open(os.path.join(folder, "key"), "rb") as f:
        key = f.read()
    world = StageWorld("127.0.0.1", free_port(), 2, 300.0, (0,), min_learners=1, rejoin_wait=30)
    request = json.dumps(
        {"argv": launch.command_line(world, 0), "env": dict(os.environ), "cwd": os.getcwd(), "path": sys.path}
        | {"new_session": True}
    ).encode()
    alive_r, alive_w = os.pipe()
    try:
        pid = int.from_bytes(_raw_request(folder, key, request, fds=(1, 2, alive_r)), "big")
    finally:
        os.close(alive_r)
        os.close(alive_w)  # never confirmed
    assert pid > 0
    while not _gone(pid):  # its rendezvous would wait 300 s
        time.sleep(0.1)


def test_a_forked_server_logs_what_it_logged_before_it_exits_and_holds_nothing_of_the_fork_server(folder, capfd):
    world = StageWorld("127.0.0.1", free_port(), 1, 0.5, (None,), learner_store=True)
    server = fork_server(folder, launch.command_line(world, 0, server_node=True), new_session=False, timeout=30)
    assert server.wait(timeout=60) == launch.NO_LEARNERS
    assert "nothing listens there" in capfd.readouterr().err  # log.error, then sys.exit
    waiting = fork_server(folder, launch.command_line(_waiting_world(), 0), new_session=False, timeout=30)
    time.sleep(1)
    held = {os.readlink(f"/proc/{waiting.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{waiting.pid}/fd")}
    from multiprocessing import forkserver, resource_tracker

    fork_servers = {forkserver._forkserver._forkserver_alive_fd, resource_tracker._resource_tracker._fd}
    assert not held & {os.readlink(f"/proc/self/fd/{fd}") for fd in fork_servers if fd is not None}
    waiting.kill()
    waiting.wait(timeout=60)


def _start_server_and_report(folder: str, port: int, queue) -> None:
    os.environ[STARTER_ENV] = folder
    server = launch.start_server(StageWorld("127.0.0.1", port, 1, 300.0, (0,)), 0)
    # a process this learner forked (a DataLoader worker) holds the write end of the server's pipe too
    forked = mp.get_context("fork").Process(target=time.sleep, args=(300,), daemon=True)
    forked.start()
    queue.put((server.pid, forked.pid))
    time.sleep(300)  # killed by the test


def test_a_forked_server_ends_when_its_learner_dies(folder):
    ctx = mp.get_context("forkserver")
    queue = ctx.Queue()
    learner = ctx.Process(target=_start_server_and_report, args=(folder, free_port(), queue))
    learner.start()
    pid, forked = queue.get(timeout=60)
    assert pid in _children(SERVER_STARTER.pid) and not _gone(pid)
    learner.kill()
    learner.join()
    try:
        while not _gone(pid):  # its rendezvous would wait 300 s: the test's timeout fails it if the end is not seen
            time.sleep(0.1)
    finally:
        os.kill(forked, signal.SIGKILL)


def test_start_server_falls_back_to_a_new_interpreter_when_the_starter_is_gone(tmp_path, monkeypatch, caplog):
    started = []
    monkeypatch.setenv(STARTER_ENV, str(tmp_path))  # no socket, no key: its owner ended
    monkeypatch.setattr(launch.subprocess, "Popen", lambda command, **kwargs: started.append(command))
    with caplog.at_level(logging.WARNING, logger=launch.__name__):
        launch.start_server(_waiting_world(), 0)
    assert started and started[0][:2] == [sys.executable, "-c"]
    assert f"the server starter in {tmp_path} did not answer" in caplog.text


def test_the_starter_and_its_folder_end_with_the_process_that_owns_it():
    code = (
        "from lightning_rudra.server.starter import SERVER_STARTER\n"
        "print(SERVER_STARTER.ensure_running(), SERVER_STARTER.pid, flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110, check=True)
    owned_folder, pid = out.stdout.split()
    while not _gone(int(pid)) or os.path.exists(owned_folder):
        time.sleep(0.1)
    assert out.stderr == ""


def test_a_forked_server_starts_as_a_fresh_one_whatever_the_users_main_set():
    """The fork server preloads the user's ``__main__``: what it set at import (a float64 default, a DEBUG root
    logger) must not reach a server, which a fresh interpreter would start without."""
    import torch

    from lightning_rudra.server import starter

    handlers, level = list(logging.root.handlers), logging.root.level
    try:
        torch.set_default_dtype(torch.float64)
        logging.basicConfig(level=logging.DEBUG, force=True)
        starter._as_a_fresh_interpreter()
        assert torch.get_default_dtype() == torch.float32
        assert logging.root.handlers == [] and logging.root.level == logging.WARNING
    finally:
        torch.set_default_dtype(torch.float32)
        logging.root.handlers[:] = handlers
        logging.root.setLevel(level)


class _NeverEnds:
    pid = 12345

    def __init__(self):
        self.killed = False

    def wait(self, timeout=None):
        raise subprocess.TimeoutExpired("server", timeout)

    def kill(self):
        self.killed = True


def test_stopping_a_server_whose_end_is_never_told_gives_up_after_twice_the_timeout(caplog):
    process = _NeverEnds()  # a forked server whose starter was stopped (SIGSTOP): its end is never reported
    with caplog.at_level(logging.WARNING, logger=launch.__name__):
        launch.stop_server(process, 0.05)
    assert process.killed and "server process 12345 did not end within 0.05 s of being killed" in caplog.text


def test_a_fit_whose_starter_cannot_start_trains_with_fresh_server_processes(monkeypatch):
    from lightning_rudra import RudraStrategy
    from tests.lightning_models import Regression, loader, quiet_trainer

    def cannot(timeout: float = 60.0) -> str:
        raise RuntimeError("the server starter did not open its socket in /tmp/x within 60 s (exit code 1)")

    monkeypatch.setattr(SERVER_STARTER, "ensure_running", cannot)
    trainer = quiet_trainer(RudraStrategy(start_method="forkserver", rpc_timeout=30), 1, max_epochs=1)
    with pytest.warns(UserWarning, match="within 60 s .*; the server processes start as fresh interpreters"):
        trainer.fit(Regression(), loader(64))
    assert trainer.strategy.stats.gradients == 4
