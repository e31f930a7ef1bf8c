"""Pushes held back by ``on_stale="block"`` in the parameter server (in-process: the functions the RPC calls run,
without RPC): a held push's reply is a future that the lagging learner's push, its loss, its wait at a collective or
the end of training completes, and a run that cannot go on fails it. The rule itself: tests/core/test_ssp.py."""

import pytest
import torch

from lightning_rudra.core.errors import LearnerLostError
from lightning_rudra.core.optimizers import OptimizerSpec
from lightning_rudra.core.protocol import ProtocolConfig
from lightning_rudra.core.registration import Registration
from lightning_rudra.core.update import Push
from lightning_rudra.server import process as server
from lightning_rudra.server.parameter_server import ParameterServer
from tests.server.test_lost_learners import lose


def blocking_server(monkeypatch, learners=2, max_staleness=1, min_learners=None, nonfinite="skip") -> ParameterServer:
    ps = ParameterServer(learners, timeout=5.0, min_learners=min_learners)
    monkeypatch.setattr(server, "_server", ps)
    params = [torch.zeros(2)]
    spec = OptimizerSpec.from_optimizer(torch.optim.SGD(params, lr=1.0), params)
    config = ProtocolConfig(learners, "async", max_staleness=max_staleness, on_stale="block", nonfinite=nonfinite)
    server.call("register", Registration(config, params, [], [spec], None, False))
    return ps


def push(learner: int, timestamp: int, grad=None):
    grad = torch.ones(2) if grad is None else grad
    return server.call_async(
        "push", Push(learner, 0, [grad], torch.ones(1, dtype=torch.bool), timestamp, [{"lr": 1.0}], [])
    )


def held_push(ps: ParameterServer):
    """Learner 0 pushes twice while learner 1 computes from clock 0: the second push is held."""
    assert push(0, 0).wait().clock == 1
    held = push(0, 1)
    assert not held.done() and ps.core.clock == 1 and set(ps.owed.held) == {0}
    return held


def test_the_held_reply_comes_with_the_lagging_learners_push(monkeypatch):
    ps = blocking_server(monkeypatch)
    held = held_push(ps)
    lagging = push(1, 0).wait()
    assert (lagging.status, lagging.staleness) == ("accepted", 1)
    reply = held.wait()
    assert (reply.status, reply.staleness, reply.clock) == ("accepted", 1, 3) and ps.core.clock == 3
    assert ps.owed.held == {} and ps.core.stats.staleness == {0: 1, 1: 2}


def test_a_lost_lagging_learner_releases_the_held_push_and_a_lost_held_learner_gets_an_error(monkeypatch):
    ps = blocking_server(monkeypatch, learners=3, max_staleness=2, min_learners=1)
    push(0, 0).wait()
    held = push(0, 1)  # learners 1 and 2 compute from clock 0
    assert not held.done()
    second = push(1, 0).wait()  # σ 1; learner 2 would now need σ 3 after learner 0's
    assert second.clock == 2 and not held.done()
    held_too = push(1, 2)
    lose(ps, 2)
    assert held.wait().clock == 4 and held_too.wait().clock == 4 and ps.core.stats.dropped == 0
    # learner 0 held, learner 1 lost; then learner 0's own push held and learner 0 lost: its reply fails, naming
    # it, and nothing of it is applied
    assert push(0, 4).wait().clock == 5 and push(0, 5).wait().clock == 6  # learner 1 (clock 4) at σ 2 at most
    held = push(0, 6)
    assert not held.done()
    lose(ps, 1)
    assert held.wait().clock == 7  # learner 0 alone now
    ps = blocking_server(monkeypatch, min_learners=1)
    held = held_push(ps)
    lose(ps, 0, "ended before training did")
    with pytest.raises(LearnerLostError, match="learner 0 was lost \\(ended before training did\\)"):
        held.wait()
    assert ps.core.clock == 1


def test_a_learner_waiting_at_a_collective_or_finished_holds_nobody_back(monkeypatch):
    ps = blocking_server(monkeypatch)
    held = held_push(ps)
    gathered = server.call_async("gather", 1, 1, "from 1")
    assert held.wait().clock == 2 and not gathered.done()
    server.call_async("gather", 1, 0, "from 0")
    assert gathered.wait() == {0: "from 0", 1: "from 1"}
    ps = blocking_server(monkeypatch)
    held = held_push(ps)
    finished = server.call_async("finish", 1)
    assert held.wait().clock == 2 and not finished.done()


def test_a_run_that_cannot_go_on_fails_the_held_push(monkeypatch):
    ps = blocking_server(monkeypatch)  # no min_learners: a loss ends training
    held = held_push(ps)
    lose(ps, 1, "ended before training did")
    with pytest.raises(LearnerLostError, match="ended before training did"):
        held.wait()
    assert ps.owed.held == {}


def test_a_gradient_with_nan_is_never_held_its_own_learner_hears_of_it_at_once(monkeypatch):
    # held, it would be refused only when another learner's push let it go: that push's reply would carry the error
    # (after its own gradient was applied) and the held reply would wait for ever
    nan = torch.tensor([float("nan"), 0.0])
    ps = blocking_server(monkeypatch, min_learners=1, nonfinite="raise")
    assert push(0, 0).wait().clock == 1
    with pytest.raises(FloatingPointError, match="learner 0 pushed a gradient with NaN or Inf"):
        push(0, 1, nan)  # would be held (learner 1 computes from clock 0): raises to learner 0, as under 'drop'
    assert ps.owed.held == {} and ps.core.gate.held == [] and ps.core.clock == 1
    reply = push(1, 0).wait()
    assert (reply.status, reply.clock) == ("accepted", 2)
    ps = blocking_server(monkeypatch, nonfinite="skip")
    assert push(0, 0).wait().clock == 1
    reply = push(0, 1, nan).wait()  # refused and counted at once: nothing of it is applied, so nobody's σ grows
    assert (reply.status, reply.clock) == ("rejected", 1) and ps.core.stats.rejected == 1 and ps.owed.held == {}


def test_a_held_push_that_fails_as_it_goes_fails_its_own_reply_not_the_call_that_let_it_go(monkeypatch):
    ps = blocking_server(monkeypatch)
    held = held_push(ps)
    apply = ps.core._apply

    def failing(push):
        if push.learner == 0:
            raise RuntimeError("the optimizer's step failed")
        return apply(push)

    monkeypatch.setattr(ps.core, "_apply", failing)
    reply = push(1, 0).wait()  # its own push went; learner 0's, let go by it, failed
    assert (reply.status, reply.clock) == ("accepted", 2)
    with pytest.raises(RuntimeError, match="the optimizer's step failed"):
        held.wait()
    assert ps.owed.held == {} and ps.core.gate.held == []
