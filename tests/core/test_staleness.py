"""Staleness with several optimizers that share parameters (:mod:`lightning_rudra.core.staleness`): scripted pushes
into the in-process server, σ checked against the updates counted by hand."""

import torch

from lightning_rudra.core.optimizers import OptimizerSpec
from lightning_rudra.core.protocol import ProtocolConfig, Server
from lightning_rudra.core.stats import Stats
from lightning_rudra.core.update import Push


def three_optimizer_server(config, momentum=0.0):
    """Weights a, s, b, c (one element each): optimizer 0 holds a and s, optimizer 1 s and b (they share s),
    optimizer 2 c alone, so that no optimizer's parameters change with every update."""
    params = [torch.zeros(1) for _ in range(4)]
    groups = ([0, 1], [1, 2], [3])
    specs = [
        OptimizerSpec.from_optimizer(torch.optim.SGD([params[i] for i in g], lr=0.1, momentum=momentum), params)
        for g in groups
    ]
    return Server(config, [p.clone() for p in params], [], specs)


def push(server, learner, optimizer, timestamp, grad=1.0, **hparams):
    size = len(server.optimizer_params[optimizer])
    packed = server.grad_layouts[optimizer].pack([torch.tensor([grad])] * size)
    hparams = {"lr": 0.1, **hparams}
    return server.push(Push(learner, optimizer, packed, torch.ones(size, dtype=torch.bool), timestamp, [hparams], []))


def test_a_waiting_gradient_whose_learner_left_is_stale_by_every_update_since_its_weights():
    # softsync, c = 3: learner 0's gradient of optimizer 0 waits for its update, then learner 0 leaves; two updates
    # of optimizer 1 move s before the update applies it: σ = 2 > max_staleness
    server = three_optimizer_server(ProtocolConfig(3, "softsync", 1, max_staleness=1))
    assert push(server, 0, 0, 0).status == "queued"
    server.finish(0)
    server.finish(2)
    for _ in range(3):
        push(server, 1, 1, 0)  # clock 1: s moved
    push(server, 1, 0, 1)
    for _ in range(3):
        push(server, 1, 1, 1)  # clock 2: s moved again
    result = push(server, 1, 0, 2)
    assert result.closed and result.update.staleness == (1, 0)  # learner 1's, from clocks 1 and 2
    assert server.stats.dropped == 1 and server.stats.staleness == {0: 7, 1: 1}


def test_dc_keeps_the_weights_a_waiting_gradient_came_from_after_its_learner_left():
    # as above, with the dc rule: the weights of clock 0 stay kept for learner 0's waiting gradient, which is
    # compared with them at its update, while learner 1 has pushed every optimizer from newer ones
    server = three_optimizer_server(ProtocolConfig(3, "softsync", 1, compensation="dc"))
    push(server, 0, 0, 0)
    server.finish(0)
    server.finish(2)
    for _ in range(3):
        push(server, 1, 1, 0)
    push(server, 1, 0, 1)
    push(server, 1, 2, 1)
    for _ in range(3):
        push(server, 1, 1, 1)
    assert server.clock == 2 and 0 in server.history.copies


def test_a_waiting_gradient_stays_stale_by_the_updates_since_its_weights_when_its_learner_pushes_again():
    # softsync, c = 4 of 4 learners, two of them finished: learner 0's gradient from clock 0 waits while learner 0
    # and learner 1 push newer ones and optimizer 1 updates twice
    server = three_optimizer_server(ProtocolConfig(4, "softsync", 1))
    push(server, 0, 0, 0)
    server.finish(2)
    server.finish(3)
    for _ in range(4):
        push(server, 1, 1, 0)
    push(server, 0, 0, 1)
    push(server, 1, 0, 1)
    for _ in range(4):
        push(server, 1, 1, 1)
    result = push(server, 0, 0, 2)
    assert server.clock == 3 and sorted(result.update.staleness) == [0, 1, 1, 2]


def test_the_updates_kept_for_an_optimizer_never_stepped_stay_bounded():
    # optimizer 1 shares s with optimizer 0, which steps, but is never stepped itself: no learner's last push of it
    # ever moves, and the updates of its parameters must not pile up with the length of the run
    server = three_optimizer_server(ProtocolConfig(2, "async"))
    sizes = []
    for steps in (1000, 1000):
        for _ in range(steps):
            for learner in (0, 1):
                timestamp = server.clock
                for optimizer in (0, 2):
                    push(server, learner, optimizer, timestamp)
        sizes.append([len(kept) for kept in server.clocks.updates])
    assert server.clock == 8000 and sizes[1] == sizes[0], sizes
    # a gradient of optimizer 1 from recent weights is stale by the updates of s since, exactly: of the last four
    # updates, learner 1's step of optimizer 0 (learner 0's own came after its backward, as in one process)
    assert push(server, 0, 1, server.clock - 4).staleness == 1
    # one from before the updates kept counts every update since its weights (the paper's i - j): never fewer
    clock = server.clock
    assert push(server, 1, 1, 0).staleness == clock


def plain_optimizers(grads, steps):
    """What torch does with the same gradients: one backward (the gradients of step ``i``), then both steps."""
    params = [torch.zeros(1, requires_grad=True) for _ in range(4)]
    optimizers = [torch.optim.SGD([params[i] for i in g], lr=0.1, momentum=0.9) for g in ([0, 1], [1, 2], [3])]
    for step in range(steps):
        for optimizer, grad in zip(optimizers, grads(step)):
            for p in optimizer.param_groups[0]["params"]:
                p.grad = torch.tensor([grad])
            optimizer.step()
    return [p.detach() for p in params]


def test_one_learner_stepping_optimizers_that_share_a_parameter_after_one_backward_is_plain_torch():
    # async, one learner, the default compensation: optimizer 1's gradient comes from the weights before optimizer
    # 0's update of s, as in one process; its own earlier step is no staleness, so no rule changes an optimizer
    server = three_optimizer_server(ProtocolConfig(1, "async", compensation="momentum"), momentum=0.9)

    def grads(step):
        return (1.0 + step, -0.5 * step, 0.25)

    for step in range(20):
        timestamp = server.clock
        for optimizer, grad in enumerate(grads(step)):
            result = push(server, 0, optimizer, timestamp, grad, momentum=0.9)
            assert result.update.rule_scale == 1.0
    assert server.stats.staleness == {0: 60}
    for p, q in zip(server.params, plain_optimizers(grads, 20)):
        assert torch.equal(p, q), (server.params, plain_optimizers(grads, 20))


def test_one_learner_accumulating_a_gradient_over_another_optimizers_steps_is_plain_torch():
    # optimizer 1's gradient comes from the weights before three steps of optimizer 0 that move s (its backward
    # came first, as when a generator's gradient is accumulated over several critic steps): in one process too
    server = three_optimizer_server(ProtocolConfig(1, "async"), momentum=0.9)
    stamp = server.clock
    for _ in range(3):
        push(server, 0, 0, server.clock, momentum=0.9)
    assert push(server, 0, 1, stamp, momentum=0.9).staleness == 0
    assert server.stats.staleness == {0: 4}


def test_the_momentum_rule_of_an_optimizer_follows_its_own_gradients_staleness():
    # async, λ = 2: optimizer 0's gradients are stale, optimizer 2's never; its update keeps its momentum and the
    # rate scaled by c/λ only (the run's mean staleness, 0.5, would switch its momentum off)
    server = three_optimizer_server(ProtocolConfig(2, "async", compensation="momentum"), momentum=0.9)
    push(server, 0, 0, 0, momentum=0.9)
    assert push(server, 1, 0, 0, momentum=0.9).staleness == 1
    result = push(server, 0, 2, 2, momentum=0.9)
    assert result.staleness == 0 and result.update.rule_scale == 0.5
    assert server.optimizers[2].param_groups[0]["momentum"] == 0.9


def test_with_overlap_a_learner_s_own_updates_missing_from_its_weights_are_staleness():
    """Review (issue 32): with overlap (Rudra-adv*) gradient n comes from the weights of reply n - 2, which lack
    the learner's own previous update; the own-steps exemption made every such gradient fresh (σ = 0), where one
    optimizer holding every parameter counts them 1 stale."""
    server = three_optimizer_server(ProtocolConfig(1, "async", overlap=True))
    replies, sigmas = [], []
    for n in range(12):  # backward, then a step of optimizer 0 and one of optimizer 1, in turn
        sigmas.append(push(server, 0, n % 2, replies[n - 2] if n >= 2 else 0).staleness)
        replies.append(server.clock)
    assert sigmas == [0, 1] + [1] * 10


def test_an_update_a_learner_s_loss_closes_is_no_own_step_of_the_learner_left():
    """Review (issue 32): softsync c = 2, learner 0's gradient waits; learner 1's loss closes the update (c = 1).
    Learner 0 did not make that step after its gradient of optimizer 1 was computed: that gradient is 1 stale."""
    server = three_optimizer_server(ProtocolConfig(2, "softsync", 1))
    assert push(server, 0, 0, 0).status == "queued"
    assert server.remove(1) == [0] and server.clock == 1
    assert push(server, 0, 1, 0).staleness == 1


def test_a_checkpoint_saved_before_per_optimizer_counts_keeps_the_momentum_rule_s_mean():
    """Review (issue 32): a run resumed from an older checkpoint read ⟨σ⟩ = 0 for its optimizer (momentum kept)."""
    old = {"clock": 10, "gradients": 10, "staleness": {"0": 3, "3": 7}}
    stats = Stats.from_dict(old)
    assert stats.mean_staleness_of(0) == stats.mean_staleness == 2.1
