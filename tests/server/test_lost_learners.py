"""What the server does when a learner is lost (in-process: the functions the RPC calls run, without RPC). With
``min_learners`` every wait completes with the learners left; without it, or with too few left, every wait
fails with a message that names the learner and why. (Real processes: test_faults.py.)"""

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from lightning_rudra.server import process as server
from lightning_rudra.server.replies import resolve
from lightning_rudra.server.parameter_server import ParameterServer
from lightning_rudra.server.membership import Membership, this_process
from lightning_rudra.core.errors import LearnerLostError, carried
from lightning_rudra.core.optimizers import OptimizerSpec
from lightning_rudra.core.protocol import ProtocolConfig
from lightning_rudra.core.registration import Registration
from lightning_rudra.core.update import Push
from lightning_rudra.transport.elastic import LearnerId


def parameter_server(monkeypatch, protocol: str, learners: int, min_learners, n: int = 1) -> ParameterServer:
    ps = ParameterServer(learners, timeout=5.0, min_learners=min_learners)
    monkeypatch.setattr(server, "_server", ps)
    params = [torch.zeros(2)]
    spec = OptimizerSpec.from_optimizer(torch.optim.SGD(params, lr=1.0), params)
    server.call("register", Registration(ProtocolConfig(learners, protocol, n=n), params, [], [spec], None, False))
    return ps


def push(learner: int, value: float, timestamp: int = 0):
    return server.call_async(
        "push",
        Push(learner, 0, [torch.full((2,), value)], torch.ones(1, dtype=torch.bool), timestamp, [{"lr": 1.0}], []),
    )


def lose(ps: ParameterServer, learner: int, why: str = "ended before training did: its process (pid 1) is gone"):
    with ps.lock:
        outcomes = ps._lose(learner, why)
    resolve(outcomes)


def test_hardsync_rounds_wait_only_for_the_learners_left(monkeypatch):
    ps = parameter_server(monkeypatch, "hardsync", 3, min_learners=2)
    first, second = push(0, 1.0), push(1, 3.0)
    assert not first.done()  # waits for learner 2
    lose(ps, 2)
    assert first.wait()[0] == "accepted" and second.done()
    assert ps.core.pull()[0][0].tolist() == [-2.0, -2.0]  # the mean of the two gradients left: SGD on their union
    replies = push(0, 2.0, 1), push(1, 2.0, 1)  # the next round: two learners
    assert all(r.done() for r in replies) and ps.core.clock == 2
    assert ps.core.stats.lost == {2: "ended before training did: its process (pid 1) is gone"}


def test_softsync_recomputes_c_from_the_learners_left(monkeypatch):
    ps = parameter_server(monkeypatch, "softsync", 4, min_learners=1, n=1)  # c = 4
    for learner in range(3):
        push(learner, 1.0).wait()
    assert ps.core.clock == 0
    lose(ps, 3)  # c = 3: the three gradients received make an update
    assert ps.core.clock == 1 and ps.core.gradients_per_update == 3
    lose(ps, 2)
    lose(ps, 1)
    assert ps.core.gradients_per_update == 1  # never below 1
    push(0, 1.0, 1).wait()
    assert ps.core.clock == 2


def test_collectives_and_the_end_of_training_complete_with_the_learners_left(monkeypatch):
    ps = parameter_server(monkeypatch, "async", 3, min_learners=2)
    gathered = [server.call_async("gather", 1, learner, f"from {learner}") for learner in (0, 2)]
    finished = [server.call_async("finish", learner) for learner in (0, 2)]
    assert not any(f.done() for f in gathered + finished)
    lose(ps, 1)
    assert all(f.wait() == {0: "from 0", 2: "from 2"} for f in gathered)
    assert all(f.done() for f in finished)
    later = [server.call_async("gather", 2, learner, learner) for learner in (0, 2)]
    assert later[1].wait() == {0: 0, 2: 2}


def test_a_launcher_reports_a_learner_whose_process_ended(monkeypatch):
    ps = parameter_server(monkeypatch, "async", 3, min_learners=1)
    server.call_async("finish", 2)
    server.call("leave", 2)
    server.call("report", 0, 2, "exit code 0")  # it had left: nothing to do
    server.call("report", 0, 1, "signal SIGKILL")
    assert ps.core.stats.lost == {1: "ended before training did (signal SIGKILL, as its launcher saw)"}
    server.call("report", 0, 1, "signal SIGKILL")  # reported twice (two launchers, or the watch first): once
    with pytest.raises(ValueError, match="report from learner 7 refused"):
        server.call("report", 7, 0, "signal SIGKILL")
    assert ps.core.stats.lost.keys() == {1}


def test_a_lost_learner_that_comes_back_is_refused(monkeypatch):
    ps = parameter_server(monkeypatch, "async", 2, min_learners=1)
    lose(ps, 1, "has not been heard from for more than 5 s (rpc_timeout): its process died or hung")
    with pytest.raises(
        RuntimeError,
        match=r"push from learner 1 refused: it was counted as lost \(it has not been "
        r"heard from for more than 5 s",
    ) as refused:
        push(1, 1.0)
    assert ps.core.stats.gradients == 0
    assert isinstance(refused.value, LearnerLostError)  # the lost learner's own process is told it was lost


@pytest.mark.parametrize(
    "learners, min_learners, lost, message",
    [
        (
            2,
            None,
            1,
            r"learner 1 \(on 10.0.0.2\) stopped with an error \(ValueError: broke\), and training cannot go on "
            r"without it \(with RudraStrategy\(min_learners=k\), training goes on while k learners are left\)",
        ),
        (
            3,
            3,
            2,
            r"learner 2 \(on a host it never named\) stopped with an error \(ValueError: broke\): 2 learners left, "
            r"fewer than min_learners=3, so training cannot go on",
        ),
    ],
)
def test_a_loss_that_training_cannot_survive_fails_every_wait_naming_it(
    monkeypatch, learners, min_learners, lost, message
):
    parameter_server(monkeypatch, "hardsync", learners, min_learners)
    for learner, address in ((0, "10.0.0.1"), (1, "10.0.0.2")):
        server.call("heartbeat", learner, address, None)
    waiting = push(1 if lost != 1 else 0, 1.0)
    server.call("leave", lost, "ValueError: broke")
    with pytest.raises(RuntimeError, match=message) as failed:
        waiting.wait()
    with pytest.raises(RuntimeError, match=message) as later:  # and every later call
        server.call_async("gather", 1, 1 if lost == 0 else 0, None)
    # what a user catches: LearnerLostError, still a RuntimeError (around fit: test_faults.py)
    assert isinstance(failed.value, LearnerLostError) and isinstance(later.value, LearnerLostError)


def test_with_min_learners_the_learners_that_started_the_servers_can_be_lost_too():
    """The servers outlive the learners that started them (one server per node, 2 nodes: learners 0 and 2)."""
    membership = Membership(4, timeout=60.0, min_learners=2)
    assert membership.lose(0, "left before training ended") is None
    assert membership.lose(2, "left before training ended") is None
    assert membership.lose(1, "left before training ended") == (
        "learner 1 (on a host it never named) left before training ended: 1 learner left, fewer than "
        "min_learners=2, so training cannot go on"
    )


def test_the_watch_finds_a_learner_whose_process_ended_on_this_machine():
    membership = Membership(2, timeout=60.0, min_learners=1)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    membership.heard(0, "127.0.0.1", this_process())
    membership.heard(1, "127.0.0.1", (this_process()[0], child.pid))
    assert membership.newly_lost() == [(1, f"ended before training did: its process (pid {child.pid}) is gone")]
    del membership.pids[1]
    membership.heard(1, "127.0.0.1", ("another-machine/pid:[1]", child.pid))  # not this machine: no pid to check
    assert membership.newly_lost() == [] and membership.pids == {0: os.getpid()}
    membership.last_heard[1] = time.monotonic() - 61  # but silence counts everywhere
    assert membership.newly_lost() == [
        (
            1,
            "has not been heard from for more than 60 s (rpc_timeout): its process "
            "died or hung, or its host cannot be reached",
        )
    ]


def test_after_training_failed_a_second_loss_does_not_change_the_reason(monkeypatch):
    ps = parameter_server(monkeypatch, "async", 3, min_learners=None)
    lose(ps, 1, "stopped with an error (ValueError: first)")
    lose(ps, 2, "stopped with an error (ValueError: second)")
    with pytest.raises(RuntimeError, match=r"learner 1 .* \(ValueError: first\), and training cannot go on"):
        server.call_async("gather", 1, 0, None)


def test_after_training_failed_the_server_ends_once_every_learner_is_lost(monkeypatch):
    """With ``min_learners`` the server has no parent to end with: learners killed together (torchrun restarting
    its workers) must still end it."""
    ps = parameter_server(monkeypatch, "async", 3, min_learners=2)
    for learner in range(3):
        lose(ps, learner)
    assert ps.failure is not None and ps.all_left.is_set()


def test_with_comeback_a_run_that_lost_every_learner_waits_and_takes_them_back(monkeypatch):
    """Lost learners that will be restarted (torchrun restarts every worker at once) are awaited: with none left,
    the first new process is admitted at once at the start of the latest epoch any learner started."""
    ps = ParameterServer(2, timeout=5.0, min_learners=1, rejoin_wait=30.0)
    monkeypatch.setattr(server, "_server", ps)
    params = [torch.zeros(2)]
    spec = OptimizerSpec.from_optimizer(torch.optim.SGD(params, lr=1.0), params)
    module = {"parameters": [["w", [2]]], "optimizers": ["SGD"]}
    server.call("register", Registration(ProtocolConfig(2, "async"), params, [], [spec], None, False, None, module))
    for learner in (0, 1):
        server.call("progress", learner, 3, 40 + learner, 7)
    push(0, 1.0).wait()
    lose(ps, 1)
    lose(ps, 0)
    assert ps.failure is None and not ps.all_left.is_set() and ps.membership.awaiting_rejoins
    admission, _ = server.call_async("rejoin", LearnerId(1, 1), module).wait()
    assert (admission.epoch, admission.global_step, admission.collectives) == (3, 41, 7)
    assert ps.membership.members == {1} and not ps.membership.awaiting_rejoins
    assert [e["event"] for e in ps.core.stats.events] == ["lost", "lost", "rejoined"]


@pytest.mark.slow  # waits for seconds
def test_with_comeback_a_run_whose_learners_do_not_come_back_in_time_ends_saying_so(monkeypatch):
    ps = parameter_server(monkeypatch, "async", 2, min_learners=2)
    ps.membership.rejoin_wait = 0.2
    lose(ps, 1)
    assert ps.failure is None and ps.membership.awaiting_rejoins
    time.sleep(0.3)
    watch = threading.Thread(target=ps.watch, daemon=True)
    watch.start()
    watch.join(10)
    assert ps.failure is not None and ps.failure.startswith(
        "learner 1 (on a host it never named) ended before training"
    )
    assert "1 learner left, fewer than min_learners=2, and no lost learner came back within 0.2 s" in ps.failure
    lose(ps, 0)
    assert ps.all_left.is_set()


def test_a_learner_stopped_by_the_user_ends_the_run_even_with_comeback(monkeypatch):
    """Ctrl-C: every learner leaves with a KeyboardInterrupt; nobody will come back, so the server ends at once."""
    ps = parameter_server(monkeypatch, "async", 2, min_learners=1)
    ps.membership.rejoin_wait = 60.0
    lose(ps, 1)
    server.call("leave", 0, "KeyboardInterrupt: ")
    assert ps.failure is not None and "fewer than min_learners=1, so training cannot go on" in ps.failure
    assert ps.all_left.is_set()


def settled(future, seconds: float = 30.0):
    """``future`` once it is done (bounded: a wait that never ends fails the test here, not by its timeout)."""
    for _ in range(int(seconds / 0.05)):
        if future.done():
            return future
        time.sleep(0.05)
    raise AssertionError("the wait was never released")


@pytest.mark.parametrize("stage", ["test", "fit"])
def test_a_loss_before_the_model_is_registered_completes_the_collectives(monkeypatch, stage):
    """validate/test/predict never register a model, nor does fit before its setup: the learners left must not wait
    for the lost one at a collective (a barrier, a logged value's sync) or at the end of training."""
    ps = ParameterServer(3, timeout=5.0, min_learners=1)
    monkeypatch.setattr(server, "_server", ps)
    gathered = [server.call_async("gather", 1, learner, learner) for learner in (0, 2)]
    lose(ps, 1)
    assert all(f.done() for f in gathered) and [f.wait() for f in gathered] == [{0: 0, 2: 2}] * 2
    if stage == "fit":  # the model registered after the loss: the protocol counts learners 0 and 2 only
        params = [torch.zeros(2)]
        spec = OptimizerSpec.from_optimizer(torch.optim.SGD(params, lr=1.0), params)
        server.call("register", Registration(ProtocolConfig(3, "hardsync"), params, [], [spec], None, False))
        assert ps.core.active == {0, 2} and ps.core.stats.lost.keys() == {1}


def test_learner_0_lost_before_it_registers_the_model_fails_the_waits_for_it(monkeypatch):
    """Learner 0 hands over the model; lost first (under min_learners), nobody will: whoever waits to attach or pull
    is told why instead of waiting forever."""
    ps = ParameterServer(2, timeout=5.0, min_learners=1)
    monkeypatch.setattr(server, "_server", ps)
    attached, pulled = server.call_async("attach", 1), server.call_async("pull")
    lose(ps, 0, "stopped with an error (ValueError: broke)")
    message = r"learner 0 \(on a host it never named\) was lost before it registered the model"
    assert attached.done() and pulled.done()
    for future in (attached, pulled):
        with pytest.raises(RuntimeError, match=message) as failed:
            future.wait()
        assert isinstance(carried(failed.value), LearnerLostError)  # torch wraps it; the learner unwraps it
    with pytest.raises(RuntimeError, match=message):  # and later
        server.call_async("attach", 1).wait()
    assert ps.failure is None  # the others may still leave, or finish a stage that needs no model


def test_a_loss_admits_a_process_that_waited_for_the_lost_learner_to_start_the_epoch(monkeypatch):
    """A new process is admitted once every learner left has started a later epoch: if the last one that had not is
    lost, the process is admitted then, not an epoch later (or never, in the last epoch)."""
    ps = ParameterServer(3, timeout=5.0, min_learners=1)
    monkeypatch.setattr(server, "_server", ps)
    params = [torch.zeros(2)]
    spec = OptimizerSpec.from_optimizer(torch.optim.SGD(params, lr=1.0), params)
    module = {"parameters": [["w", [2]]], "optimizers": ["SGD"]}
    server.call("register", Registration(ProtocolConfig(3, "async"), params, [], [spec], None, False, None, module))
    for learner in range(3):
        server.call("progress", learner, 2, 20, 4)
    lose(ps, 2)
    reply = server.call_async("rejoin", LearnerId(2, 1), module)
    server.call("progress", 0, 3, 30, 5)
    assert not reply.done()  # learner 1 has not started epoch 3
    lose(ps, 1)
    assert reply.done()
    admission, _ = reply.wait()
    assert (admission.epoch, admission.global_step) == (3, 30) and ps.membership.members == {0, 2}


class BrokenStderr:
    """A stderr whose reader is gone (a closed terminal, a pipe nobody reads any more): every write raises."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.slow  # waits for seconds
def test_a_server_whose_stderr_is_broken_releases_the_survivors_and_watches_on(monkeypatch, server_logging):
    """The server announces a loss on its stderr (its own handler, as a server process has): with that stderr
    broken, the learners left are released all the same, and the watch goes on to see the next loss."""
    broken = BrokenStderr()
    monkeypatch.setattr(sys, "stderr", broken)
    server_logging(broken)
    ps = parameter_server(monkeypatch, "hardsync", 3, min_learners=1)
    children = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(2)]
    for child in children:
        child.wait()
    ps.membership.heard(0, "127.0.0.1", this_process())
    ps.membership.heard(1, "127.0.0.1", (this_process()[0], children[0].pid))
    waiting = [push(0, 1.0), push(2, 1.0)]  # the round waits for learner 1, whose process has ended
    watch = threading.Thread(target=ps.watch, daemon=True)
    watch.start()
    assert [settled(f).wait()[0] for f in waiting] == ["accepted"] * 2
    ps.membership.heard(2, "127.0.0.1", (this_process()[0], children[1].pid))  # learner 2's process ends too
    for _ in range(600):
        if 2 in ps.membership.lost:
            break
        time.sleep(0.05)
    assert ps.membership.lost.keys() == {1, 2} and watch.is_alive()
    ps.all_left.set()


def test_a_register_that_fails_leaves_no_file_and_learner_0_s_loss_fails_the_waits_for_the_model(monkeypatch):
    """Learner 0's register fails after the shared memory was made (an optimizer state that does not load, on
    resume): the files go at once, and when learner 0 leaves with its error, the others' attach fails naming it."""
    before = set(os.listdir("/dev/shm"))
    ps = ParameterServer(2, timeout=5.0, min_learners=1)
    monkeypatch.setattr(server, "_server", ps)
    params = [torch.zeros(2)]
    spec = OptimizerSpec.from_optimizer(torch.optim.SGD(params, lr=0.5, momentum=0.9), params)
    attach = server.call_async("attach", 1)
    broken = [{"state": {0: {"momentum_buffer": torch.zeros(5)}}, "param_groups": "x"}]
    with pytest.raises(Exception):
        server.call("register", Registration(ProtocolConfig(2, "async"), params, [], [spec], None, True, broken, None))
    assert ps.core is None and set(os.listdir("/dev/shm")) <= before
    server.call("leave", 0, "RuntimeError: the register failed")
    with pytest.raises(RuntimeError, match="lost before it registered the model"):
        settled(attach).wait()
