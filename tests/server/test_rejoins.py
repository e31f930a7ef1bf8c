"""What the server does when a new process asks to take a lost learner's place (in-process, without RPC): it is
checked, waits for every learner to start the same epoch, and is admitted there; an earlier process of the learner
is refused from then on. (Real processes: tests/strategy/test_rejoin.py.)"""

import subprocess
import sys
import time

import pytest
import torch

from lightning_rudra.server import process as server
from lightning_rudra.server.membership import this_process
from lightning_rudra.server.parameter_server import ParameterServer
from lightning_rudra.server.rejoins import Admission, describe_module
from lightning_rudra.core.optimizers import OptimizerSpec
from lightning_rudra.core.protocol import ProtocolConfig
from lightning_rudra.core.registration import Registration
from lightning_rudra.core.update import Push
from lightning_rudra.transport.elastic import LearnerId
from tests.server.test_lost_learners import lose, push

MODULE = describe_module([("net.weight", (2,))], ["torch.optim.sgd.SGD"])


def elastic_server(monkeypatch, protocol: str = "async", learners: int = 3) -> ParameterServer:
    ps = ParameterServer(learners, timeout=5.0, min_learners=1)
    monkeypatch.setattr(server, "_server", ps)
    params = [torch.zeros(2)]
    spec = OptimizerSpec.from_optimizer(torch.optim.SGD(params, lr=0.5), params)
    server.call(
        "register", Registration(ProtocolConfig(learners, protocol), params, [], [spec], None, False, None, MODULE)
    )
    return ps


def test_a_new_process_is_admitted_when_every_learner_has_started_a_later_epoch(monkeypatch):
    ps = elastic_server(monkeypatch)
    for learner in range(3):
        server.call("progress", learner, 0, 0, 0)
    lose(ps, 2)
    reply = server.call_async("rejoin", LearnerId(2, 1), MODULE)
    server.call("heartbeat", LearnerId(2, 1), "127.0.0.1")  # it may beat while it waits
    with pytest.raises(RuntimeError, match="push from learner 2 refused: it has asked to rejoin and waits"):
        push(LearnerId(2, 1), 1.0)
    server.call("progress", 0, 1, 40, 3)
    assert not reply.done()  # learner 1 has not started epoch 1 yet
    server.call("progress", 1, 1, 38, 3)
    where, hparams = reply.wait()
    assert where == Admission(epoch=1, global_step=40, collectives=3)
    assert hparams[0][0]["lr"] == 0.5
    assert ps.membership.members == {0, 1, 2} and ps.core.active == {0, 1, 2}
    assert [(e["learner"], e["event"]) for e in ps.core.stats.events] == [(2, "lost"), (2, "rejoined")]
    assert ps.core.stats.lost == {}
    push(LearnerId(2, 1), 1.0).wait()  # the new process pushes
    with pytest.raises(RuntimeError, match="push from learner 2 refused: this process of it was counted as lost"):
        push(2, 1.0)  # the old one, woken up


def test_under_hardsync_the_round_open_at_admission_waits_for_the_new_process(monkeypatch):
    ps = elastic_server(monkeypatch, "hardsync", learners=2)
    server.call("progress", 0, 0, 0, 0)
    server.call("progress", 1, 0, 0, 0)
    lose(ps, 1)
    reply = server.call_async("rejoin", LearnerId(1, 1), MODULE)
    server.call("progress", 0, 1, 16, 0)  # learner 0, alone, starts epoch 1: learner 1 is admitted
    assert reply.done()
    first = push(0, 1.0, timestamp=ps.core.clock)
    assert not first.done()  # the round waits for the admitted learner
    push(LearnerId(1, 1), 3.0, timestamp=ps.core.clock).wait()
    assert first.done() and ps.core.pull()[0][0].tolist() == [-2.0, -2.0]  # the pushes' lr 1 × the mean gradient 2


def test_a_process_with_another_module_or_for_a_live_learner_is_refused(monkeypatch):
    ps = elastic_server(monkeypatch)
    other = describe_module([("net.weight", (3,)), ("net.bias", (1,))], ["torch.optim.adam.Adam"])
    with pytest.raises(RuntimeError, match=r"learner 1 cannot rejoin: learner 1 \(on .*\) is alive"):
        server.call_async("rejoin", LearnerId(1, 1), MODULE)
    lose(ps, 1)
    with pytest.raises(ValueError, match="its module differs") as refused:
        server.call_async("rejoin", LearnerId(1, 1), other)
    message = str(refused.value)
    assert "parameter 'net.weight' has shape (3,), the run's (2,)" in message
    assert "parameter 'net.bias' is not in the run's module" in message
    assert "its optimizers are ['torch.optim.adam.Adam'], the run's ['torch.optim.sgd.SGD']" in message
    assert 1 not in ps.membership.joining and ps.core.stats.lost.keys() == {1}


def test_a_process_waiting_when_training_ends_is_told_so(monkeypatch):
    ps = elastic_server(monkeypatch, learners=2)
    lose(ps, 1)
    reply = server.call_async("rejoin", LearnerId(1, 1), MODULE)
    server.call_async("finish", 0)
    assert reply.wait() is None and ps.membership.joining == {}
    late = server.call_async("rejoin", LearnerId(1, 2), MODULE)  # after the end: at once
    assert late.wait() is None


def test_an_admission_carries_the_runs_elapsed_time(monkeypatch):
    ps = elastic_server(monkeypatch, learners=2)
    server.call("progress", 0, 0, 0, 0)
    server.call("progress", 1, 0, 0, 0)
    lose(ps, 1)
    time.sleep(0.2)
    reply = server.call_async("rejoin", LearnerId(1, 1), MODULE)
    server.call("progress", 0, 1, 16, 0)
    where, _ = reply.wait()
    assert 0.2 <= where.elapsed < 60


def push_deltas(learner, count: int = 0):
    """A push whose reply's weights come as bf16 differences (compression="bf16", a server on another host)."""
    return server.call_async(
        "push_deltas",
        "bf16",
        count,
        Push(learner, 0, [torch.ones(2)], torch.ones(1, dtype=torch.bool), 0, [{"lr": 0.5}], []),
    ).wait()


def test_the_weights_a_learners_process_holds_are_forgotten_once_it_is_lost_or_leaves(monkeypatch):
    """The server keeps, per learner pushing with weight deltas, the float32 copy of what it holds: one per process
    that ever pushed would grow with every rejoin."""
    ps = elastic_server(monkeypatch, learners=2)
    push_deltas(0)
    for incarnation in range(1, 6):
        push_deltas(LearnerId(1, incarnation - 1))
        server.call("progress", 0, incarnation - 1, 0, 0)
        server.call("report", 0, 1, "exit code 1")  # its launcher saw it end
        assert held(ps) == [0]  # the lost process's copy went
        reply = server.call_async("rejoin", LearnerId(1, incarnation), MODULE)
        server.call("progress", 0, incarnation, 0, 0)
        assert reply.done()
    push_deltas(LearnerId(1, 5))
    assert held(ps) == [0, 1]
    server.call("leave", LearnerId(1, 5))
    assert held(ps) == [0]


def held(ps) -> list:
    """The learners whose weights the server keeps a copy of."""
    return sorted(key for deltas in ps.weight_deltas.values() for key in deltas.held)


def test_a_second_process_refused_for_a_lost_learner_leaves_the_first_ones_admission_alone(monkeypatch):
    """Two processes ask for lost learner 1's place (A, then B): B is refused, beats, and ends; A is still admitted."""
    ps = elastic_server(monkeypatch, learners=2)
    server.call("progress", 0, 0, 0, 0)
    lose(ps, 1)
    first, second = LearnerId(1, 1), LearnerId(1, 2)
    server.call("heartbeat", first, "127.0.0.1", this_process())
    reply = server.call_async("rejoin", first, MODULE)
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    server.call("heartbeat", second, "127.0.0.1", (this_process()[0], ended.pid))  # B's process, ended since
    with pytest.raises(RuntimeError, match="another new process for it is already waiting to be admitted"):
        server.call_async("rejoin", second, MODULE)
    server.call("leave", second, "RuntimeError: learner 1 cannot rejoin: another new process for it is already ...")
    with ps.lock:
        assert ps.membership.newly_failed_joins() == []  # B's end is not A's
    assert not reply.done() and ps.membership.joining == {1: 1}
    server.call("progress", 0, 1, 8, 0)
    where, _ = reply.wait()
    assert where.epoch == 1 and ps.membership.members == {0, 1} and ps.membership.incarnations[1] == 1


def test_a_launchers_late_report_about_an_earlier_process_does_not_count_its_successor_lost(monkeypatch):
    ps = elastic_server(monkeypatch, learners=2)
    machine = this_process()[0]
    old, new = (machine, 1001), (machine, 1002)  # learner 1's first process, and the one that takes its place
    server.call("heartbeat", 1, "127.0.0.1", old)
    server.call("progress", 0, 0, 0, 0)
    server.call("report", 0, 1, "signal SIGKILL", old)
    assert ps.membership.lost.keys() == {1}
    server.call("heartbeat", LearnerId(1, 1), "127.0.0.1", new)
    reply = server.call_async("rejoin", LearnerId(1, 1), MODULE)
    server.call("report", 0, 1, "signal SIGKILL", old)  # again, late: the new process waits to rejoin
    assert not reply.done()
    server.call("progress", 0, 1, 8, 0)
    assert reply.wait()[0].epoch == 1
    server.call("report", 0, 1, "signal SIGKILL", old)  # and once more, now that the new process trains
    assert ps.membership.members == {0, 1}
    server.call("report", 0, 1, "exit code 1", new)  # the new process's own end counts
    assert ps.membership.lost == {1: "ended before training did (exit code 1, as its launcher saw)"}


@pytest.mark.slow  # waits for seconds
def test_the_popen_launcher_names_the_process_it_saw_end(tmp_path):
    from lightning_fabric.plugins.environments import LightningEnvironment

    from lightning_rudra.strategy.launchers.popen import PopenLauncher

    reports = []
    launcher = PopenLauncher(
        LightningEnvironment(), 2, 1, min_learners=1, report=lambda *report: reports.append(report)
    )
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    launcher.procs = [child]
    with pytest.warns(UserWarning, match="learner 1's process ended with exit code 3"):
        launcher._observe()  # returns once every child's end is reported (no restart)
    assert reports == [(1, "exit code 3", (this_process()[0], child.pid))]


def test_a_process_waiting_to_rejoin_when_training_is_given_up_is_told_why(monkeypatch):
    """min_learners=2 of 3: learner 2 is lost and a new process for it waits for the next epoch; learner 1 is lost
    too, leaving too few: the waiting process, and any that asks later while the server is up, hears why training
    stopped (not, once the server ends, that it is gone)."""
    ps = elastic_server(monkeypatch, learners=3)
    ps.membership.min_learners = 2
    for learner in range(3):
        server.call("progress", learner, 0, 0, 0)
    lose(ps, 2)
    reply = server.call_async("rejoin", LearnerId(2, 1), MODULE)
    assert not reply.done()  # it waits for the learners to start epoch 1
    lose(ps, 1)
    assert ps.failure is not None and "fewer than min_learners=2" in ps.failure
    assert reply.done()
    with pytest.raises(
        RuntimeError, match=r"learner 2 could not rejoin: training stopped: learner 1 .* min_learners=2"
    ):
        reply.wait()
    assert ps.membership.joining == {}
    with pytest.raises(RuntimeError, match=r"^learner 1 .* fewer than min_learners=2, so training cannot go on"):
        server.call_async("rejoin", LearnerId(1, 2), MODULE)


def test_a_second_process_that_beat_before_the_first_asked_leaves_the_first_ones_admission_alone(monkeypatch):
    """B, a second process for lost learner 1, beats after A's first beat and before A asks to rejoin: B's end
    (refused, it leaves) must not fail A's admission, which the watch decides by the process it watches."""
    ps = elastic_server(monkeypatch, learners=2)
    server.call("progress", 0, 0, 0, 0)
    lose(ps, 1)
    first, second = LearnerId(1, 1), LearnerId(1, 2)
    ending = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    try:
        server.call("heartbeat", first, "127.0.0.1", this_process())
        server.call("heartbeat", second, "127.0.0.1", (this_process()[0], ending.pid))
        reply = server.call_async("rejoin", first, MODULE)
        with pytest.raises(RuntimeError):
            server.call_async("rejoin", second, MODULE)
        server.call("leave", second, "RuntimeError: refused")
    finally:
        ending.wait(timeout=30)
    ps._look()  # one round of the watch, before the first process beats again
    assert not reply.done(), "the first process's admission failed for the second process's end"
