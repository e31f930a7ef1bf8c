"""K-batch-sync and backup learners without processes (lightning_rudra.core.rounds): scripted pushes into the
in-process server, and the shared epoch's pool dealing late batches again."""

import pytest
import torch

from lightning_rudra.core.config import ProtocolConfig
from lightning_rudra.core.epoch import EpochPlan, EpochPool
from lightning_rudra.core.errors import ConfigurationError
from lightning_rudra.core.optimizers import OptimizerSpec
from lightning_rudra.core.protocol import Server
from lightning_rudra.core.update import Push


def make_server(learners=4, protocol="batchsync", **options):
    w = torch.zeros(2)
    opt = torch.optim.SGD([w], lr=0.1)
    config = ProtocolConfig(learners, protocol, **options)
    return Server(config, [w], [], [OptimizerSpec.from_optimizer(opt, [w])])


def push(server, learner, grad, timestamp):
    return server.push(
        Push(learner, 0, [torch.tensor(grad)], torch.tensor([True]), timestamp, [{"lr": 0.1, "momentum": 0.0}], [])
    )


def weights(server):
    return server.params[0].tolist()


def test_batchsync_updates_after_the_first_k_gradients_of_the_current_weights_from_any_learners():
    server = make_server(learners=3, k=3)
    assert server.config.gradients_per_update == 3
    # learner 0 is fast: it gives two gradients of the weights of clock 0, learner 1 one; learner 2 is slow
    assert push(server, 0, [1.0, 0.0], 0).status == "accepted"
    assert push(server, 0, [2.0, 0.0], 0).status == "accepted"
    result = push(server, 1, [3.0, 3.0], 0)
    assert result.closed and result.update.staleness == (0, 0, 0)
    assert server.clock == 1 and weights(server) == pytest.approx([-0.2, -0.1])
    # learner 2's gradient of clock 0 comes after its round closed: not applied, answered with σ it would have had
    late = push(server, 2, [100.0, 100.0], 0)
    assert (late.status, late.staleness, late.closed) == ("late", 1, False)
    assert weights(server) == pytest.approx([-0.2, -0.1])
    assert (server.stats.late, server.stats.gradients, server.stats.staleness) == (1, 3, {0: 3})


def test_batchsync_k_defaults_to_lambda_and_equals_hardsync_with_one_gradient_per_learner():
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    x, y = torch.randn(24, 5), torch.randn(24, 1)
    params = list(model.parameters())
    servers = {}
    for protocol in ("hardsync", "batchsync"):
        copies = [p.detach().clone() for p in params]
        spec = OptimizerSpec.from_optimizer(torch.optim.SGD(copies, lr=0.1, momentum=0.9), copies)
        servers[protocol] = Server(ProtocolConfig(3, protocol), copies, [], [spec])
    assert servers["batchsync"].config.gradients_per_update == 3
    for server in servers.values():
        for step in range(4):
            flat, _, clock = server.pull()
            for learner in range(3):
                for p, w in zip(params, server.param_layout.unpack(flat)):
                    p.data.copy_(w)
                model.zero_grad()
                rows = torch.arange(step * 6, step * 6 + 6)[learner::3]
                torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
                grads = server.grad_layouts[0].pack([p.grad for p in params])
                hparams = [{"lr": 0.1, "momentum": 0.9}]
                server.push(Push(learner, 0, grads, torch.tensor([True, True]), clock, hparams, []))
    assert servers["batchsync"].clock == servers["hardsync"].clock == 4
    for theirs, mine in zip(servers["batchsync"].params, servers["hardsync"].params):
        torch.testing.assert_close(theirs, mine, rtol=0, atol=0)


def test_batchsync_applies_no_rule_and_counts_a_nonfinite_gradient_out_of_k():
    server = make_server(learners=2, k=2, compensation="momentum")
    assert server.rules == ()
    assert push(server, 0, [float("nan"), 0.0], 0).status == "rejected"
    assert not push(server, 1, [1.0, 1.0], 0).closed  # the rejected one does not count towards K
    assert push(server, 1, [1.0, 1.0], 0).closed and server.clock == 1


def test_backup_round_takes_the_first_lambda_minus_b_learners_and_answers_the_late_one_at_once():
    server = make_server(learners=4, protocol="hardsync", backup=1)
    assert not push(server, 0, [1.0, 0.0], 0).closed
    assert not push(server, 1, [2.0, 0.0], 0).closed
    result = push(server, 2, [3.0, 3.0], 0)
    assert result.closed and result.update.staleness == (0, 0, 0)
    assert weights(server) == pytest.approx([-0.2, -0.1])
    assert push(server, 3, [50.0, 50.0], 0).status == "late"  # the straggler's: round 0 closed
    # the next round: the straggler, now on clock 1, may be among the first three
    assert not push(server, 3, [1.0, 1.0], 1).closed
    with pytest.raises(RuntimeError, match="learner 3 pushed twice"):
        push(server, 3, [1.0, 1.0], 1)
    assert (server.stats.late, server.stats.gradients) == (1, 4)


def test_backup_round_closes_once_the_learners_not_at_a_collective_have_pushed():
    server = make_server(learners=4, protocol="hardsync", backup=1)
    assert not push(server, 0, [1.0, 1.0], 0).closed
    assert server.meet({2, 3}) == [] and server.clock == 0  # learner 1 trains on: the round waits for it
    assert server.meet({1, 2, 3}) == [0] and server.clock == 1
    assert weights(server) == pytest.approx([-0.1, -0.1])
    assert server.meet(set()) == []  # no round open


def test_backup_round_waits_for_fewer_learners_once_some_are_lost():
    server = make_server(learners=4, protocol="hardsync", backup=1)
    server.remove(3)
    push(server, 0, [1.0, 1.0], 0)
    assert push(server, 1, [1.0, 1.0], 0).closed  # λ' = 3 learners left: 2 of them
    server.remove(2)
    server.remove(1)
    assert push(server, 0, [1.0, 1.0], 1).closed  # one learner left: at least one gradient a round


def test_plain_hardsync_and_softsync_discard_nothing_late():
    for protocol in ("hardsync", "softsync", "async"):
        assert not ProtocolConfig(2, protocol).discards_late
    assert ProtocolConfig(2, "batchsync").discards_late and ProtocolConfig(2, "hardsync", backup=1).discards_late
    server = make_server(learners=2, protocol="softsync")
    push(server, 0, [1.0, 1.0], 0)
    assert push(server, 1, [1.0, 1.0], 0).status == "accepted"  # σ = 1, applied


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(protocol="softsync", k=2), "k=2 is K-batch-sync's round size"),
        (dict(protocol="batchsync", k=0), "k=0 is not valid"),
        (dict(protocol="batchsync", k=True), "k=True is not valid"),
        (dict(protocol="async", backup=1), "backup=1 is for protocol='hardsync'"),
        (dict(protocol="hardsync", backup=-1), "backup=-1 is not valid"),
        (dict(protocol="hardsync", backup=4), "backup=4 with λ=4 learners leaves no learner"),
        (dict(protocol="batchsync", max_staleness=2), "nothing to bound with protocol='batchsync'"),
        (dict(protocol="hardsync", backup=1, overlap=True), "overlap=True is not available with backup=1"),
    ],
)
def test_bad_round_options_are_refused(options, message):
    with pytest.raises(ConfigurationError, match=message):
        ProtocolConfig(4, **options)


def test_several_optimizers_are_refused_under_batchsync():
    a, b = torch.zeros(2), torch.zeros(1)
    specs = [OptimizerSpec.from_optimizer(torch.optim.SGD([p], lr=0.1), [a, b]) for p in (a, b)]
    with pytest.raises(ConfigurationError, match="protocol='batchsync' is not available with 2 optimizers"):
        Server(ProtocolConfig(2, "batchsync"), [a, b], [], specs)


def draw(pool, learner, epoch=0, trained=None, late=()):
    indices, position, what = pool.draw(epoch, learner, pool.plan, 1, trained, late)
    return (None if indices is None else indices.tolist(), position, what)


def test_a_late_batch_is_dealt_again_to_another_learner_first():
    pool = EpochPool(EpochPlan(8, 2, shuffle=False), num_learners=2)
    assert draw(pool, 0) == ([0, 1], 0, "batch")  # learner 0's batch 0 (its place 0)
    assert draw(pool, 1) == ([2, 3], 1, "batch")
    # learner 0 says its place 0 came late: the batch goes to the next learner that asks, not back to learner 0
    assert draw(pool, 0, trained=1, late=[0]) == ([4, 5], 2, "batch")
    assert draw(pool, 1, trained=1) == ([0, 1], 0, "again")
    assert pool.redealt == 1
    assert draw(pool, 1, trained=2) == ([6, 7], 3, "batch")
    assert draw(pool, 0, trained=2) == (None, 4, "epoch")
    # learner 1 is lost holding its last batch: that one is dealt again, the acknowledged ones are not
    assert pool.lose(1) == 1


def test_a_learners_own_late_batch_comes_back_to_it_once_nothing_new_is_left():
    pool = EpochPool(EpochPlan(4, 2, shuffle=False), num_learners=2)
    assert draw(pool, 0) == ([0, 1], 0, "batch")
    assert draw(pool, 1) == ([2, 3], 1, "batch")
    assert draw(pool, 0, trained=1, late=[0]) == ([0, 1], 0, "again")  # drained: the straggler trains it after all
    assert pool.lose(0) == 1  # held again, not yet trained: a loss deals it again


def test_a_late_batch_of_an_earlier_epoch_is_trained_in_the_next():
    pool = EpochPool(EpochPlan(4, 2, shuffle=False), num_learners=2)
    draw(pool, 0)
    draw(pool, 1)
    assert draw(pool, 1, trained=1) == (None, 2, "epoch")
    assert draw(pool, 1, epoch=1, trained=1) == ([0, 1], 0, "batch")
    assert draw(pool, 0, epoch=1, trained=1, late=[0]) == ([2, 3], 1, "batch")
    assert draw(pool, 1, epoch=1, trained=2) == ([0, 1], 1, "again")  # epoch 0's batch, at epoch 1's place


@pytest.mark.parametrize("late", [[5], [-1], [True], ["0"], "0", [0, 0]])
def test_a_late_place_the_learner_does_not_hold_is_refused(late):
    pool = EpochPool(EpochPlan(8, 2, shuffle=False), num_learners=2)
    draw(pool, 0)
    with pytest.raises(ValueError, match="late|came late"):
        draw(pool, 0, trained=1, late=late)


def test_a_straggler_gets_its_own_late_batch_back_once_unless_the_others_are_all_away():
    pool = EpochPool(EpochPlan(4, 2, shuffle=False), num_learners=2)
    assert draw(pool, 0) == ([0, 1], 0, "batch")
    assert draw(pool, 1) == ([2, 3], 1, "batch")
    assert draw(pool, 0, trained=1, late=[0]) == ([0, 1], 0, "again")  # drained: back to it, once
    # late again while learner 1 trains on (here, in the next epoch): learner 1 takes it, not learner 0 again
    assert draw(pool, 0, trained=2, late=[1]) == (None, 2, "epoch")
    assert draw(pool, 1, epoch=1, trained=1) == ([0, 1], 0, "again")
    # the same, but learner 1 waits at a collective (alone): learner 0 trains it again, nobody can make it late
    pool = EpochPool(EpochPlan(4, 2, shuffle=False), num_learners=2)
    draw(pool, 0)
    draw(pool, 1)
    assert draw(pool, 0, trained=1, late=[0]) == ([0, 1], 0, "again")
    indices, _, what = pool.draw(0, 0, pool.plan, 1, 2, [1], alone=True)
    assert (indices.tolist(), what) == ([0, 1], "again")
