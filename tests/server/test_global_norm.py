"""Hardsync clipping by norm over two servers' parts, in-process (the functions the RPC calls run, without RPC):
each round's replies wait for the other server's part of the norm, and a part that cannot be delivered, or a learner
lost meanwhile, fails the round's waits instead of leaving them forever. (Real processes: test_strategy.py.)"""

import pytest
import torch

from lightning_rudra.core.clipping import Clipping
from lightning_rudra.core.optimizers import OptimizerSpec
from lightning_rudra.core.protocol import ProtocolConfig
from lightning_rudra.core.registration import Registration
from lightning_rudra.server.replies import resolve
from lightning_rudra.server.parameter_server import ParameterServer
from lightning_rudra.core.update import Push

CLIPPING = (Clipping(1.0, "norm", (0, 1), None),)


def two_servers() -> tuple[list[ParameterServer], list[tuple]]:
    """Servers 0 and 1 of a model of two weights, one each; what each sends to the other is kept, to deliver."""
    sent: list[tuple] = []
    servers = []
    for server in (0, 1):
        ps = ParameterServer(2, timeout=5.0, server=server)
        ps.send_norm = lambda to, *norm, server=server: sent.append((to, server, *norm))
        params = [torch.zeros(1)]
        spec = OptimizerSpec.from_optimizer(torch.optim.SGD(params, lr=1.0), params)
        ps.register(Registration(ProtocolConfig(2, "hardsync"), params, [], [spec], None, False))
        servers.append(ps)
    return servers, sent


def push(ps: ParameterServer, learner: int, value: float, clipping=CLIPPING):
    return ps.push(
        Push(
            learner,
            0,
            [torch.full((1,), value)],
            torch.ones(1, dtype=torch.bool),
            0,
            [{"lr": 1.0}],
            [],
            True,
            clipping=clipping,
        )
    )


def deliver(servers: list[ParameterServer], sent: list[tuple]) -> None:
    while sent:
        to, sender, optimizer, round, partial = sent.pop(0)
        servers[to].round_norm(sender, optimizer, round, partial)


def test_a_round_waits_for_the_other_servers_part_of_the_norm_then_clips_by_the_whole_norm():
    servers, sent = two_servers()
    replies = [push(servers[0], learner, 3.0) for learner in (0, 1)] + [push(servers[1], 0, 4.0)]
    assert not any(r.done() for r in replies) and len(sent) == 1  # server 0's part (9) is on its way to server 1
    replies.append(push(servers[1], 1, 4.0))
    assert not any(r.done() for r in replies) and servers[0].core.clock == 0 == servers[1].core.clock
    deliver(servers, sent)
    assert all(r.wait().status == "accepted" for r in replies)
    # the round's gradient [3 | 4] has norm 5: clipped to 1, each server's part by the same factor
    assert servers[0].core.pull()[0][0].tolist() == pytest.approx([-0.6])
    assert servers[1].core.pull()[0][0].tolist() == pytest.approx([-0.8])
    assert servers[0].norm_exchange.norms == {} == servers[1].norm_exchange.norms


@pytest.mark.parametrize("call", [("1", 0, 1, 9.0), (1, 0, 1, float("nan")), (1, True, 1, 9.0), (1, 0, -1, 9.0)])
def test_a_bad_part_of_a_norm_is_refused_by_name_and_changes_nothing(call):
    servers, sent = two_servers()
    with pytest.raises(ValueError, match=r"round_norm.* is not valid: expected a server, an optimizer and a round"):
        servers[0].round_norm(*call)
    assert servers[0].norm_exchange.norms == {}


def test_a_part_that_cannot_be_sent_ends_training_with_why_and_a_lost_learner_releases_the_other_server():
    servers, sent = two_servers()
    replies = [push(ps, learner, 3.0) for ps in servers for learner in (0, 1)]
    servers[0].norm_not_sent(1, RuntimeError("connection refused"))  # server 1 died
    for reply in replies[:2]:
        with pytest.raises(
            RuntimeError, match="could not send its part of the gradient's norm .* to parameter server 1"
        ):
            reply.wait()
    # server 1 never gets server 0's part: its round's waits end when the learners are lost, as every wait does
    with servers[1].lock:
        outcomes = servers[1]._lose(0, "ended before training did")
    resolve(outcomes)
    for reply in replies[2:]:
        with pytest.raises(RuntimeError, match="learner 0"):
            reply.wait()


def test_learners_whose_clippings_differ_are_refused_instead_of_waiting_forever():
    # the newest push's request held, and push order differs per server: server 0 waited for a norm server 1 never
    # sent (it applied its round without clipping). Now each server refuses the push that differs from its first.
    servers, sent = two_servers()
    replies = [push(servers[0], 1, 3.0, ())]
    with pytest.raises(ValueError, match=r"learner 0 asked for clipping by norm to 1.0 .* learner 1 for no clipping"):
        push(servers[0], 0, 3.0)
    replies.append(push(servers[1], 0, 4.0))
    with pytest.raises(ValueError, match=r"learner 1 asked for no clipping .* learner 0 for clipping by norm to 1.0"):
        push(servers[1], 1, 4.0, ())
    deliver(servers, sent)
    assert not any(r.done() for r in replies) and not sent  # the refused learners fail: their loss ends the rounds
    for ps in servers:
        with ps.lock:
            outcomes = ps._lose(0, "failed")
        resolve(outcomes)
    for reply in replies:
        with pytest.raises(RuntimeError, match="learner 0"):
            reply.wait()


def rounds_waiting_for_parts() -> tuple[list[ParameterServer], list[tuple], list]:
    """Both servers' first rounds closed, each waiting for the other's part (undelivered, in ``sent``)."""
    servers, sent = two_servers()
    replies = [push(ps, learner, value) for ps, value in zip(servers, (3.0, 4.0)) for learner in (0, 1)]
    return servers, sent, replies


@pytest.mark.parametrize(
    "call, message",
    [
        ((0, 0, 1, 1e6), r"from server 0 .* expected another server among \(0, 1\)"),  # its own shard
        ((2, 0, 1, 1.0), r"from server 2 .* expected another server among \(0, 1\)"),
        ((1, 7, 1, 1.0), r"optimizer 7 .* expected one of 0 to 0"),
        ((1, 0, 10**9, 1.0), r"round 1000000000 .* expected round 1 or 2"),
    ],
)
def test_a_part_of_a_norm_from_elsewhere_or_for_another_round_is_refused_and_kept_nowhere(call, message):
    servers, sent, replies = rounds_waiting_for_parts()
    with pytest.raises(ValueError, match=message):
        servers[0].round_norm(*call)
    deliver(servers, sent)
    assert servers[0].core.pull()[0][0].tolist() == pytest.approx([-0.6])  # clipped by the norm 5 of [3 | 4]
    assert all(r.wait().status == "accepted" for r in replies)
    assert servers[0].norm_exchange.norms == {} == servers[1].norm_exchange.norms


def test_the_first_part_of_a_norm_holds_and_a_late_one_for_a_round_that_applied_is_refused():
    servers, sent = two_servers()
    replies = [push(servers[0], learner, 3.0) for learner in (0, 1)] + [push(servers[1], 0, 4.0)]
    deliver([servers[0], servers[1]], sent)  # server 0's part (9) reaches server 1 before its round closes
    with pytest.raises(ValueError, match=r"server 0 .* round 1 .* sent already \(9.0\); the first holds"):
        servers[1].round_norm(0, 0, 1, 0.0)
    replies.append(push(servers[1], 1, 4.0))
    deliver(servers, sent)
    assert all(r.wait().status == "accepted" for r in replies)
    assert servers[1].core.pull()[0][0].tolist() == pytest.approx([-0.8])  # clipped by the norm 5 of [3 | 4]
    with pytest.raises(ValueError, match=r"round 1 .* expected round 2 or 3"):  # that round applied
        servers[0].round_norm(1, 0, 1, 16.0)
    assert servers[0].norm_exchange.norms == {} == servers[1].norm_exchange.norms
