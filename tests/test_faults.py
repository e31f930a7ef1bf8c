"""Faults injected into a real run (async, 2 learners forked, a real server process), read as a table:

| fault, mid-run                        | expected                                                          |
| ------------------------------------- | ----------------------------------------------------------------- |
| kill -9 of the server                 | every learner ends with an error that names the server            |
| kill -9 of learner 0 (the server's    | the run ends; the server, orphaned, exits                         |
|   parent)                             |                                                                   |
| SIGSTOP of learner 1 past rpc_timeout | counted as lost: the run ends with an error that names learner 1  |

Each asserts the error and that no process of the run is left. (A learner that raises or exits:
test_strategy.py; a host cut off: test_hosts.py.)
"""

import os
import signal
import threading
import time

import pytest

from lightning_rudra import RudraStrategy
from lightning_rudra.rpc_world import free_port
from tests.lightning_models import START, Regression, loader, quiet_trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TIMEOUT = 5.0  # rpc_timeout of these runs


class Marked(Regression):
    """Each learner writes its pid to ``<dir>/learner<rank>`` when training starts, then steps slowly."""

    def __init__(self, directory: str) -> None:
        super().__init__(lr=0.01)
        self.directory = directory

    def on_train_start(self) -> None:
        with open(os.path.join(self.directory, f"learner{self.global_rank}"), "w") as file:
            file.write(str(os.getpid()))

    def training_step(self, batch, batch_idx):
        time.sleep(0.02)
        return super().training_step(batch, batch_idx)


def server_pids(port: int) -> list[int]:
    """The server process of the run on ``port``, if it is still there (read from /proc: ps may cut lines)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                command = file.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
        if entry.isdigit() and "lightning_rudra.server" in command and f"tcp://127.0.0.1:{port} " in command:
            found.append(int(entry))
    return found


def pid_of(tmp_path, who: str, port: int) -> int:
    for _ in range(600):  # bounded: 120 s
        if who == "server" and server_pids(port):
            return server_pids(port)[0]
        marker = tmp_path / who
        if who != "server" and marker.exists() and marker.read_text():
            return int(marker.read_text())
        time.sleep(0.2)
    raise AssertionError(f"{who} never started")


def run_with_fault(tmp_path, monkeypatch, who: str, signum: int) -> tuple[str, list[int]]:
    """Fit for a long time; once both learners train, send ``signum`` to ``who``. Returns the error's text and
    the pids that were still alive a while after the fit ended (stopped ones are let go first)."""
    port = free_port()
    monkeypatch.setenv("MASTER_PORT", str(port))
    signalled: list[int] = []

    failures: list[BaseException] = []

    def inject() -> None:
        learners: list[int] = []
        try:
            learners += [pid_of(tmp_path, "learner0", port), pid_of(tmp_path, "learner1", port)]
            time.sleep(1.0)  # some steps first
            target = pid_of(tmp_path, who, port)
        except BaseException as failure:  # end the run instead of letting it train on: the test fails below
            failures.append(failure)
            for pid in learners:
                _signal(pid, signal.SIGKILL)
            raise
        signalled.append(target)
        os.kill(target, signum)

    injector = threading.Thread(target=inject, daemon=True)
    injector.start()
    trainer = quiet_trainer(RudraStrategy(protocol="async", start_method=START, rpc_timeout=TIMEOUT), 2,
                            max_epochs=1000)
    with pytest.raises(Exception) as raised:
        trainer.fit(Marked(str(tmp_path)), loader(8))
    injector.join(timeout=10)
    assert not failures, failures
    pids = [pid_of(tmp_path, f"learner{rank}", port) for rank in range(2)]
    for pid in signalled:  # a stopped process cannot even die until it runs again
        _signal(pid, signal.SIGCONT)
    for _ in range(40):  # the server notices within about a second that its parent or its learners are gone
        alive = [pid for pid in pids if _alive(pid)] + server_pids(port)
        if not alive:
            break
        time.sleep(0.25)
    return str(raised.value), alive


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_killed_server_ends_every_learner_with_an_error_that_names_it(tmp_path, monkeypatch):
    error, alive = run_with_fault(tmp_path, monkeypatch, "server", signal.SIGKILL)
    assert "the parameter server (on 127.0.0.1) is gone: its connection closed" in error, error
    assert alive == []


def test_a_killed_learner_0_ends_the_run_and_its_server(tmp_path, monkeypatch):
    error, alive = run_with_fault(tmp_path, monkeypatch, "learner0", signal.SIGKILL)
    assert "process 0 terminated with signal SIGKILL" in error, error
    assert alive == []


def test_a_learner_stalled_past_the_timeout_is_lost_and_the_run_ends_naming_it(tmp_path, monkeypatch):
    error, alive = run_with_fault(tmp_path, monkeypatch, "learner1", signal.SIGSTOP)
    assert "learner 1 (on 127.0.0.1) has not been heard from for more than 5 s" in error, error
    assert alive == []
