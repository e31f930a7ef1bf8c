"""batchsync's pacing (lightning_rudra.server.pacing) with times by hand: whose reply waits for the round."""

import heapq
from typing import Any

import pytest
import torch

from lightning_rudra.core.config import ProtocolConfig
from lightning_rudra.core.errors import LearnerLostError
from lightning_rudra.core.registration import Registration
from lightning_rudra.server import process as server
from lightning_rudra.server.parameter_server import ParameterServer
from lightning_rudra.server.replies import resolve
from lightning_rudra.server.waits import open_waits
from lightning_rudra.core.optimizers import OptimizerSpec
from lightning_rudra.core.protocol import Server
from lightning_rudra.core.update import Push
from lightning_rudra.server.pacing import RoundPacing


def measured(pacing: RoundPacing, steps: dict[int, float]) -> None:
    """Each learner handed the weights of clock 0 at 0 and pushing after its step: its step time is measured."""
    for learner, step in steps.items():
        pacing.handed_out(learner, 0.0, 0)
        pacing.pushed(learner, step)


def test_equal_learners_wait_for_the_round_a_faster_one_by_a_whole_step_does_not():
    pacing = RoundPacing(k=3)
    measured(pacing, {0: 1.0, 1: 1.0, 2: 1.0})
    for learner in (1, 2):
        pacing.handed_out(learner, 10.0, 5)  # computing on the weights of clock 5, due at 11
    # learner 0 pushed at 11 (received 1 of 3); its next would be due at 12, the others' at 11: it waits
    assert pacing.waits(0, 11.0, 5, 1, {0, 1, 2})
    # three times faster, its next (due at 11.33) still comes after learners 1 and 2 close the round (at 11)
    pacing.step[0] = 1 / 3
    assert pacing.waits(0, 11.0, 5, 1, {0, 1, 2})
    # with learner 2 a straggler (due at 13) the round needs learner 0's next gradient, due at 11.33: answered now
    pacing.step[2] = 3.0
    assert not pacing.waits(0, 11.0, 5, 1, {0, 1, 2})


def test_an_unmeasured_learner_is_not_held_and_others_on_older_weights_do_not_count():
    pacing = RoundPacing(k=2)
    pacing.handed_out(1, 0.0, 4)  # on the weights of clock 4: its gradient will be late at clock 5
    assert not pacing.waits(0, 1.0, 5, 1, {0, 1})  # learner 0 not measured yet
    measured(pacing, {0: 1.0})
    assert not pacing.waits(0, 1.0, 5, 1, {0, 1}), "learner 1 cannot close the round of clock 5"
    assert not pacing.enough(5, 1, {1}, 1.0) and pacing.enough(4, 1, {1}, 1.0)


def test_held_replies_are_let_go_once_the_learners_computing_cannot_close_the_round():
    w = torch.zeros(2)
    opt = torch.optim.SGD([w], lr=0.1)
    core = Server(ProtocolConfig(3, "batchsync"), [w], [], [OptimizerSpec.from_optimizer(opt, [w])])
    core.push(Push(0, 0, [torch.ones(2)], torch.tensor([True]), 0, [{"lr": 0.1}], []))
    pacing = RoundPacing(k=3)
    measured(pacing, {0: 1.0, 1: 1.0, 2: 1.0})
    pacing.handed_out(1, 0.0, 0)
    pacing.handed_out(2, 0.0, 0)
    assert pacing.hold(0, 1.0, core, set()) and pacing.waiting == {0}
    assert not pacing.cannot_close(core, set(), 1.0)  # learners 1 and 2 bring the two gradients missing
    assert pacing.cannot_close(core, {2}, 1.0), "learner 2 went to a collective: the round cannot close"
    pacing.forget(1)
    assert pacing.cannot_close(core, set(), 1.0) and 1 not in pacing.step
    pacing.handed_out(0, 2.0, 0)
    assert not pacing.waiting


def test_a_held_reply_is_answered_once_the_gradient_it_waits_for_is_overdue():
    """A stalled learner (alive, silent in its own code) does not hold the others' replies for ever: once its
    gradient is twice its step time late, the server's watch answers them."""
    w = torch.zeros(2)
    opt = torch.optim.SGD([w], lr=0.1)
    core = Server(ProtocolConfig(2, "batchsync"), [w], [], [OptimizerSpec.from_optimizer(opt, [w])])
    core.push(Push(0, 0, [torch.ones(2)], torch.tensor([True]), 0, [{"lr": 0.1}], []))
    pacing = RoundPacing(k=2)
    measured(pacing, {0: 1.0, 1: 1.0})
    pacing.handed_out(1, 0.5, 0)  # learner 1's gradient due at 1.5
    assert pacing.hold(0, 1.0, core, set())
    assert not pacing.cannot_close(core, set(), 2.0)  # a little late: still waited for
    assert pacing.cannot_close(core, set(), 100.0), "overdue: the held reply is answered"
    assert not pacing.waits(0, 100.0, 0, 1, {0, 1}), "nor is a new push held for it"


class _Clock:
    """A hand-moved time.monotonic for the server's pacing."""

    now = 0.0

    @classmethod
    def monotonic(cls) -> float:
        return cls.now


def paced_server(monkeypatch, learners: int = 3, min_learners=None, attach_first=False) -> ParameterServer:
    """A batchsync ParameterServer (K = λ) answering through the process's entry points, on a hand-moved clock; every
    learner attached (its first weights) at 0, after learner 0 registered the model or (``attach_first``, as learners
    without shared memory may) before."""
    from lightning_rudra.server import model_server, owed_replies

    _Clock.now = 0.0
    monkeypatch.setattr(model_server, "time", _Clock)
    monkeypatch.setattr(owed_replies, "time", _Clock)
    ps = ParameterServer(learners, timeout=50.0, min_learners=min_learners)
    monkeypatch.setattr(server, "_server", ps)
    params = [torch.zeros(2)]
    spec = OptimizerSpec.from_optimizer(torch.optim.SGD(params, lr=1.0), params)
    registration = Registration(ProtocolConfig(learners, "batchsync"), params, [], [spec], None, False)
    if not attach_first:
        server.call("register", registration)
    for learner in range(learners):
        server.call("attached", learner, False)
    if attach_first:
        server.call("register", registration)
    return ps


def drive(steps: dict[int, float], starts: dict[int, tuple[float, int]], pushes: int) -> None:
    """Each learner pushes a step after it got weights (``starts``: learner -> (when, their clock)) and again a step
    after each reply, ``pushes`` pushes in all."""
    events = [(when + steps[learner], learner, clock) for learner, (when, clock) in starts.items()]
    heapq.heapify(events)
    pending: dict[int, Any] = {}
    for _ in range(pushes):
        t, learner, clock = heapq.heappop(events)
        _Clock.now = t
        pending[learner] = server.call_async("push", Push(learner, 0, [torch.ones(2)], ONE, clock, [{"lr": 1.0}], []))
        for who, reply in list(pending.items()):
            if reply.done():
                heapq.heappush(events, (t + steps[who], who, reply.wait().clock))
                del pending[who]


STEPS = {0: 1.0, 1: 1.001, 2: 1.002}
ONE = torch.ones(1, dtype=torch.bool)


@pytest.mark.parametrize("attach_first", [False, True])
def test_equal_learners_give_one_gradient_each_per_round_from_the_first(monkeypatch, attach_first):
    ps = paced_server(monkeypatch, attach_first=attach_first)
    drive(STEPS, {learner: (0.0, 0) for learner in STEPS}, 24)
    assert ps.core.stats.late == 0 and ps.core.clock == 8


def test_learners_back_from_a_long_collective_still_wait_for_the_round(monkeypatch):
    ps = paced_server(monkeypatch)
    drive(STEPS, {learner: (0.0, 0) for learner in STEPS}, 9)  # 3 rounds, every reply answered
    assert (ps.core.clock, ps.core.stats.late) == (3, 0)
    _Clock.now = 4.0
    gathered = [server.call_async("gather", 1, learner, None) for learner in (0, 1)]
    _Clock.now = 9.0  # learner 2 comes 5 s (5 steps) later
    gathered.append(server.call_async("gather", 1, 2, None))
    assert all(g.done() for g in gathered)
    drive(STEPS, {learner: (9.0, 3) for learner in STEPS}, 9)
    assert (ps.core.clock, ps.core.stats.late) == (6, 0)


def test_a_lost_learners_paced_reply_fails_and_its_steps_are_forgotten(monkeypatch):
    ps = paced_server(monkeypatch, min_learners=1)
    drive(STEPS, {learner: (0.0, 0) for learner in STEPS}, 3)  # round 0: steps measured
    _Clock.now = 2.0
    reply = server.call_async("push", Push(0, 0, [torch.ones(2)], ONE, 1, [{"lr": 1.0}], []))
    assert not reply.done(), "learners 1 and 2 close the round first: learner 0's reply waits"
    with ps.lock:
        assert "batchsync round of optimizer 0 (replies paced)" in str(open_waits(ps))
        outcomes = ps._lose(0, "killed")
    resolve(outcomes)
    with pytest.raises(LearnerLostError):
        reply.wait()
    replies = []
    for learner in (1, 2):
        _Clock.now += 0.01
        replies.append(server.call_async("push", Push(learner, 0, [torch.ones(2)], ONE, 1, [{"lr": 1.0}], [])))
    assert all(r.done() for r in replies) and ps.core.clock == 2 and 0 not in ps.owed.pacing.handed
