"""Protocol semantics without processes: scripted pushes into the in-process server, weights by hand."""

from dataclasses import replace

import pytest
import torch

from lightning_rudra.core.flat import FlatLayout
from lightning_rudra.core.optimizers import OptimizerSpec, hyperparameters
from lightning_rudra.core.protocol import ProtocolConfig, Server
from lightning_rudra.core.stats import Stats
from lightning_rudra.core.update import Push


def make_server(
    protocol="softsync",
    n=1,
    learners=2,
    lr_modulation="none",
    max_staleness=None,
    nonfinite="skip",
    momentum=0.0,
    buffers=(),
):
    w = torch.zeros(2)
    opt = torch.optim.SGD([w], lr=0.1, momentum=momentum)
    config = ProtocolConfig(learners, protocol, n, lr_modulation, max_staleness, nonfinite)
    return Server(config, [w], list(buffers), [OptimizerSpec.from_optimizer(opt, [w])])


def push(server, learner, grad, timestamp, lr=0.1, buffers=()):
    return server.push(
        Push(
            learner,
            0,
            [torch.tensor(grad, dtype=torch.float32)],
            torch.tensor([True]),
            timestamp,
            [{"lr": lr, "momentum": 0.0}],
            server.buffer_layout.pack([torch.tensor(b) for b in buffers]),
        )
    )


def weights(server):
    return server.params[0].tolist()


def test_hardsync_waits_for_every_learner_and_averages():
    server = make_server("hardsync", learners=3)
    assert not push(server, 0, [1.0, 0.0], 0).closed
    assert not push(server, 2, [2.0, 0.0], 0).closed
    assert server.clock == 0 and weights(server) == [0.0, 0.0]
    result = push(server, 1, [3.0, 3.0], 0)
    assert result.closed and result.update.staleness == (0, 0, 0)
    assert server.clock == 1
    assert weights(server) == pytest.approx([-0.2, -0.1])  # -0.1 * mean([1,2,3]), -0.1 * mean([0,0,3])


def test_hardsync_refuses_a_second_gradient_in_one_round():
    server = make_server("hardsync", learners=2)
    push(server, 0, [1.0, 1.0], 0)
    with pytest.raises(RuntimeError, match="learner 0 pushed twice"):
        push(server, 0, [1.0, 1.0], 0)
    assert server.clock == 0 and server.stats.gradients == 1


def test_softsync_updates_every_c_gradients_with_mean_modulation():
    # λ = 4, n = 2: c = 2 gradients per update, from any learners.
    server = make_server("softsync", n=2, learners=4, lr_modulation="mean")
    assert server.config.gradients_per_update == 2
    script = [  # (learner, timestamp, expected σ)
        (0, 0, 0),
        (1, 0, 0),  # update 1 at clock 0: mean σ 0 -> lr 0.1
        (2, 0, 1),
        (3, 0, 1),  # update 2: mean σ 1 -> lr 0.1
        (0, 1, 1),
        (1, 0, 2),  # update 3: mean σ 1.5 -> lr 0.1 / 1.5
        (2, 0, 3),
        (3, 2, 1),  # update 4: mean σ 2 -> lr 0.05
    ]
    updates = []
    for learner, timestamp, sigma in script:
        result = push(server, learner, [1.0, 2.0], timestamp)
        assert result.staleness == sigma
        if result.update:
            updates.append(result.update)
    assert [u.lr_factor for u in updates] == pytest.approx([1.0, 1.0, 1 / 1.5, 0.5])
    assert server.clock == 4
    step = 0.1 * (1 + 1 + 1 / 1.5 + 0.5)
    assert weights(server) == pytest.approx([-step, -2 * step])
    assert server.stats.staleness == {0: 2, 1: 4, 2: 1, 3: 1}
    assert server.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05)


def test_async_with_per_gradient_modulation_scales_each_gradient():
    server = make_server("async", learners=2, lr_modulation="per_gradient")
    expected = torch.zeros(2)
    for learner, timestamp, grad, scale in [
        (0, 0, [1.0, 0.0], 1.0),
        (1, 0, [0.0, 1.0], 1.0),
        (0, 1, [2.0, 2.0], 1.0),
        (1, 1, [4.0, 4.0], 0.5),
    ]:
        result = push(server, learner, grad, timestamp)
        assert result.closed and result.update.gradient_scales == (scale,)
        assert result.update.lr_factor == 1.0
        expected -= 0.1 * scale * torch.tensor(grad)
    assert server.clock == 4
    assert weights(server) == pytest.approx(expected.tolist())


def test_max_staleness_drops_and_counts_without_touching_weights():
    server = make_server("async", learners=3, max_staleness=1)
    push(server, 0, [1.0, 1.0], 0)
    push(server, 1, [1.0, 1.0], 0)  # σ = 1: kept
    before = weights(server)
    result = push(server, 2, [5.0, 5.0], 0)  # σ = 2 > 1: dropped
    assert result.status == "dropped" and result.staleness == 2
    assert result.closed and result.update is None  # it was this update's one gradient: nothing to apply
    assert weights(server) == before and server.clock == 2
    assert server.stats.to_dict() == {
        "clock": 2,
        "gradients": 3,
        "dropped": 1,
        "rejected": 0,
        "late": 0,
        "held": 0,
        "clipped": 0,
        "staleness": {0: 1, 1: 1},
        "optimizer_staleness": {0: {0: 1, 1: 1}},
        "batches": {},
        "redealt": 0,
        "lost": {},
        "events": [],
    }


def two_optimizer_server(learners=2, n=1, lr_modulation="none", max_staleness=None, protocol="softsync", shared=False):
    """Weights a (optimizer 0) and b (optimizer 1), one element each, plain SGD with lr 1. ``shared``: optimizer 1
    holds a too (its pushes carry no gradient for it, but an update of optimizer 1 may change a)."""
    a, b = torch.zeros(1), torch.zeros(1)
    groups = ([a], [a, b] if shared else [b])
    specs = [OptimizerSpec.from_optimizer(torch.optim.SGD(g, lr=1.0), [a, b]) for g in groups]
    config = ProtocolConfig(learners, protocol, n, lr_modulation, max_staleness)
    return Server(config, [a, b], [], specs)


def push_to(server, optimizer, learner, grad, timestamp, **hparams):
    """A gradient ``grad`` for optimizer 0's a or optimizer 1's b (with ``shared``, none for a)."""
    shared = len(server.grad_layouts[optimizer]) == 2
    packed, has_grad = ([torch.tensor([0.0, grad])], [False, True]) if shared else ([torch.tensor([grad])], [True])
    hparams = {"lr": 1.0, **hparams}
    return server.push(Push(learner, optimizer, packed, torch.tensor(has_grad), timestamp, [hparams], []))


def test_a_gradient_is_stale_only_by_the_updates_of_its_own_optimizers_parameters():
    # λ = 2, async. Optimizer 0's updates do not touch b: they make no gradient of optimizer 1 stale.
    server = two_optimizer_server(protocol="async")
    script = [  # (optimizer, learner, timestamp, expected σ)
        (0, 0, 0, 0),  # clock 1
        (1, 1, 0, 0),  # b has not changed since clock 0: clock 2
        (1, 0, 0, 1),  # one update of b since: clock 3
        (0, 1, 0, 1),  # one update of a since: clock 4
        (0, 0, 2, 1),  # a changed at clock 4
        (1, 1, 3, 0),
    ]
    for optimizer, learner, timestamp, sigma in script:
        assert push_to(server, optimizer, learner, 1.0, timestamp).staleness == sigma
    assert server.stats.staleness == {0: 3, 1: 3} and server.clock == 6


def test_a_bool_is_neither_a_learner_nor_an_optimizer_index():
    """Python counts True as 1: a push from learner True for optimizer True would be learner 1's for optimizer 1."""
    server = two_optimizer_server(protocol="async")
    with pytest.raises(ValueError, match="optimizer index True is not valid: expected an int"):
        push_to(server, True, 0, 1.0, 0)
    with pytest.raises(ValueError, match="learner True is not a learner's index: expected an int"):
        push_to(server, 1, True, 1.0, 0)
    assert server.clock == 0 and server.stats.gradients == 0 and server.params[1].tolist() == [0.0]


def clocks_kept(server):
    return [[update.clock for update in kept] for kept in server.clocks.updates]


def test_the_server_keeps_only_the_updates_a_gradient_may_still_be_stale_by():
    server = two_optimizer_server(protocol="async")
    for step in range(50):
        for learner in (0, 1):
            timestamp = server.clock
            for optimizer in (0, 1):
                push_to(server, optimizer, learner, 1.0, timestamp)
    # the learners' last pushes came from the weights of clock 196 and 198: the updates after 196 (two each)
    assert server.clock == 200 and clocks_kept(server) == [[197, 199], [198, 200]]
    assert push_to(server, 1, 0, 1.0, 196).staleness == 2
    for step in range(10):  # an optimizer no longer stepped keeps no other's updates alive
        push_to(server, 0, step % 2, 1.0, server.clock)
    assert clocks_kept(server)[0] == [server.clock - 1, server.clock]
    server.finish(0)
    server.finish(1)
    assert server.clocks.oldest(server.clock) == server.clock


def test_one_learner_stepping_two_optimizers_after_one_backward_is_plain_sgd_for_each():
    # a GAN's step, async with one learner under the default compensation: nothing is stale, so no rule changes
    # the optimizers (a σ of 1 from the other optimizer's update switched momentum off and rescaled the rate)
    a, b = torch.zeros(1), torch.zeros(1)
    specs = [OptimizerSpec.from_optimizer(torch.optim.SGD([p], lr=0.1, momentum=0.9), [a, b]) for p in (a, b)]
    server = Server(ProtocolConfig(1, "async", compensation="momentum"), [a, b], [], specs)
    local = [torch.zeros(1, requires_grad=True) for _ in range(2)]
    plain = [torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in local]
    for step in range(20):
        timestamp = server.clock  # one backward, then both steps
        for optimizer, grad in enumerate((1.0 + step, -0.5 * step)):
            push_to(server, optimizer, 0, grad, timestamp, lr=0.1, momentum=0.9)
            local[optimizer].grad = torch.tensor([grad])
            plain[optimizer].step()
    assert server.stats.staleness == {0: 40}
    for p, q in zip(server.params, local):
        assert torch.equal(p, q.detach())


@pytest.mark.parametrize("lr_modulation, expected_a", [("none", -1.0), ("mean", -0.5), ("per_gradient", -0.5)])
def test_several_optimizers_count_staleness_when_the_gradient_is_applied(lr_modulation, expected_a):
    # λ = 2, 1-softsync: c = 2. Optimizer 0's first gradient waits while two updates of optimizer 1, which holds a
    # too, move a's clock.
    server = two_optimizer_server(lr_modulation=lr_modulation, shared=True)
    assert push_to(server, 0, 0, 1.0, 0).status == "queued"
    for learner in (0, 1, 0, 1):
        push_to(server, 1, learner, 1.0, server.clock)
    assert server.clock == 2 and server.stats.staleness == {0: 4}
    result = push_to(server, 0, 1, 1.0, 0)
    assert result.status == "accepted" and result.update.staleness == (2, 2)  # both from the weights of clock 0
    assert server.stats.staleness == {0: 4, 2: 2}
    # none: lr × mean(1, 1); mean: lr / ⟨σ⟩ = lr / 2; per_gradient: mean(1/2, 1/2)
    assert server.params[0].item() == pytest.approx(expected_a)


def test_several_optimizers_drop_by_the_staleness_at_application():
    server = two_optimizer_server(max_staleness=1, shared=True)
    push_to(server, 0, 0, 1.0, 0)
    for learner in (0, 1, 0, 1):
        push_to(server, 1, learner, 1.0, server.clock)
    result = push_to(server, 0, 1, 3.0, 2)
    assert result.update.staleness == (0,) and server.stats.dropped == 1  # σ = 2 at application > 1
    assert server.params[0].item() == pytest.approx(-3.0)


def test_hardsync_with_two_optimizer_steps_per_batch_is_never_stale():
    # one backward, then both optimizers step, as in one process: optimizer 1's gradients come from the weights
    # before optimizer 0's round, and nothing about that is stale under hardsync (max_staleness=0 dropped them)
    server = two_optimizer_server(max_staleness=0, protocol="hardsync")
    for step in range(2):
        timestamp = server.clock
        for optimizer in (0, 1):
            for learner in (0, 1):
                push_to(server, optimizer, learner, 1.0, timestamp)
    assert server.stats.staleness == {0: 8} and server.stats.dropped == 0
    assert [p.item() for p in server.params] == [-2.0, -2.0]


def test_a_learning_rate_tensor_travels_as_a_number():
    w = torch.zeros(2)
    opt = torch.optim.SGD([w], lr=torch.tensor(0.5))
    spec = OptimizerSpec.from_optimizer(opt, [w])
    assert spec.groups[0][1]["lr"] == 0.5 and type(spec.groups[0][1]["lr"]) is float
    server = Server(ProtocolConfig(1, "async"), [w], [], [spec])
    server.push(Push(0, 0, [torch.ones(2)], torch.tensor([True]), 0, [hyperparameters(opt.param_groups[0])], []))
    assert weights(server) == [-0.5, -0.5]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_gradient_is_refused_and_counted(bad):
    server = make_server("async", learners=1)
    result = push(server, 0, [bad, 1.0], 0)
    assert result.status == "rejected" and result.update is None
    assert weights(server) == [0.0, 0.0] and server.clock == 0 and server.stats.rejected == 1


def test_nonfinite_gradient_raises_when_asked_and_leaves_weights():
    server = make_server("async", learners=1, nonfinite="raise")
    with pytest.raises(FloatingPointError, match="NaN or Inf"):
        push(server, 0, [float("nan"), 1.0], 0)
    assert weights(server) == [0.0, 0.0] and server.clock == 0


def test_hardsync_round_with_a_refused_gradient_averages_the_others():
    server = make_server("hardsync", learners=2)
    push(server, 0, [float("nan"), 0.0], 0)
    result = push(server, 1, [2.0, 2.0], 0)
    assert result.closed and result.update.staleness == (0,)
    assert weights(server) == pytest.approx([-0.2, -0.2])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda s: push(s, 5, [1.0, 1.0], 0), "learner 5 is unknown"),
        (lambda s: push(s, 0, [1.0, 1.0, 1.0], 0), "float32 x 3"),
        (
            lambda s: s.push(
                Push(0, 0, [torch.ones(2, dtype=torch.float64)], torch.tensor([True]), 0, [{"lr": 0.1}], [])
            ),
            "torch.float64 x 2",
        ),
        (lambda s: push(s, 0, [1.0, 1.0], 7), "timestamp 7"),
        (lambda s: push(s, 0, [1.0, 1.0], 0, lr=float("nan")), "learning rate nan"),
        (
            lambda s: s.push(Push(0, 3, [torch.ones(2)], torch.tensor([True]), 0, [{"lr": 0.1}], [])),
            "optimizer index 3",
        ),
        # a bool is an int to Python: True would be learner 1, optimizer 1
        (lambda s: s.push(pushed(learner=True)), "learner True is not a learner's index: expected an int"),
        (lambda s: s.push(pushed(learner=1.0)), "learner 1.0 is not a learner's index"),
        (lambda s: s.push(pushed(optimizer=0.0)), "optimizer index 0.0 is not valid"),
        # fields of the wrong type: refused by name, not a TypeError or AttributeError from reading them
        (lambda s: s.push(pushed(hparams=None)), "hparams=None from learner 0 is not valid: expected a list of 1"),
        (lambda s: s.push(pushed(hparams={"lr": 0.1})), "hparams={'lr': 0.1} from learner 0 is not valid"),
        (lambda s: s.push(pushed(buffers=None)), "the buffers pushed by learner 0 are a NoneType: expected a list"),
        (lambda s: s.push(pushed(grads=torch.ones(1, 2))), "learner 0 for optimizer 0 are a Tensor: expected a list"),
        (lambda s: s.push(pushed(members=None)), "members=None from learner 0 is not valid: expected a list of"),
        (lambda s: s.push(pushed(refused=None)), "refused=None from learner 0 is not valid"),
        (lambda s: s.push(pushed(members=[True])), "members=.True. from learner 0 is not valid"),
        (lambda s: s.push(pushed(clipping=None)), "clipping=None is not valid: expected a tuple"),
        # anything but True, False or None would skip the check for NaN and Inf
        (lambda s: s.push(pushed([float("nan"), 1.0], finite="no")), "finite='no' from learner 0 is not valid"),
        (lambda s: s.push(pushed([float("nan"), 1.0], finite=1)), "finite=1 from learner 0 is not valid: expected"),
    ],
)
def test_bad_push_is_refused_with_a_clear_error_and_changes_nothing(call, message):
    server = make_server("async", learners=2)
    push(server, 0, [1.0, 1.0], 0)
    before = (weights(server), server.stats.to_dict())
    with pytest.raises(ValueError, match=message):
        call(server)
    assert (weights(server), server.stats.to_dict()) == before


def pushed(grad=(1.0, 1.0), **fields):
    """Learner 0's push of ``grad`` to :func:`make_server`'s server, with ``fields`` in place of a good push's."""
    good = Push(0, 0, [torch.tensor(grad)], torch.tensor([True]), 0, [{"lr": 0.1, "momentum": 0.0}], [])
    return replace(good, **fields)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(protocol="bulksync"), "protocol='bulksync'"),
        (dict(n=0), "n=0"),
        (dict(protocol="softsync", n=3), "n=3 is larger than the number of learners λ=2"),
        (dict(n=2), "n=2 is softsync's splitting parameter, and protocol='async' has none"),
        (dict(protocol="hardsync", n=2), "protocol='softsync', n=2"),
        (dict(max_staleness=-1), "max_staleness=-1"),
        (dict(lr_modulation="sqrt"), "lr_modulation='sqrt'"),
        (dict(nonfinite="ignore"), "nonfinite='ignore'"),
    ],
)
def test_bad_configuration_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ProtocolConfig(num_learners=2, **kwargs)


def test_finish_flushes_pending_softsync_gradients():
    server = make_server("softsync", n=1, learners=3)  # c = 3
    push(server, 0, [3.0, 0.0], 0)
    push(server, 1, [0.0, 3.0], 0)
    assert server.finish(0) == [] and server.clock == 0
    server.finish(1)
    assert server.finish(2) == [0]
    assert server.clock == 1 and weights(server) == pytest.approx([-0.15, -0.15])


def test_hardsync_round_closes_when_the_missing_learner_finishes():
    server = make_server("hardsync", learners=3)
    push(server, 0, [1.0, 1.0], 0)
    push(server, 1, [3.0, 3.0], 0)
    assert server.finish(2) == [0]
    assert weights(server) == pytest.approx([-0.2, -0.2])
    with pytest.raises(ValueError, match="learner 2 has already finished"):
        push(server, 2, [1.0, 1.0], 1)


def test_buffers_are_averaged_and_integer_buffers_take_the_last_value():
    server = make_server("hardsync", learners=2, buffers=[torch.zeros(2), torch.tensor(0)])
    push(server, 0, [0.0, 0.0], 0, buffers=[[1.0, 2.0], 5])
    push(server, 1, [0.0, 0.0], 0, buffers=[[3.0, 4.0], 7])
    _, buffers, _ = server.pull()
    assert [b.tolist() for b in server.buffer_layout.unpack(buffers)] == [[2.0, 3.0], 7]


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=1e-2),
        lambda groups: torch.optim.Adam(groups, lr=0.01),
        lambda groups: torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1),
    ],
    ids=["sgd-momentum", "adam", "adamw"],
)
def test_async_with_one_learner_is_the_plain_optimizer(make_optimizer):
    torch.manual_seed(0)
    local = [torch.randn(3, 2), torch.randn(4), torch.randn(2)]
    unused = 2  # never gets a gradient: the optimizer must skip it (no weight decay, no momentum)
    local_opt = make_optimizer([{"params": local[:1]}, {"params": local[1:], "lr": 0.05}])
    spec = OptimizerSpec.from_optimizer(local_opt, local)
    server = Server(ProtocolConfig(1, "async"), [p.clone() for p in local], [], [spec])
    layout = server.grad_layouts[0]
    for step in range(5):
        grads = [torch.randn_like(p) for p in local]
        grads[unused] = None
        for group in local_opt.param_groups:  # a learner-side LR schedule
            group["lr"] *= 0.9
        hparams = [{k: v for k, v in g.items() if k != "params"} for g in local_opt.param_groups]
        packed = layout.pack([g if g is not None else torch.zeros_like(p) for g, p in zip(grads, local)])
        server.push(Push(0, 0, packed, torch.tensor([g is not None for g in grads]), step, hparams, []))
        for p, g in zip(local, grads):
            p.grad = g
        local_opt.step()
    for mine, theirs in zip(local, server.params):
        torch.testing.assert_close(theirs, mine, rtol=0, atol=0)
    assert server.optimizer_state(0)["param_groups"][1]["lr"] == pytest.approx(0.05 * 0.9**5)
    assert server.optimizer_state(0)["state"].keys() == local_opt.state_dict()["state"].keys()


def test_hardsync_equals_sgd_on_the_union_batch():
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    x, y = torch.randn(24, 5), torch.randn(24, 1)
    reference = torch.nn.Linear(5, 1)
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    params = list(model.parameters())
    spec = OptimizerSpec.from_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), params)
    learners, mu = 3, 2
    server = Server(ProtocolConfig(learners, "hardsync"), params, [], [spec])
    for step in range(4):
        batch = slice(step * mu * learners, (step + 1) * mu * learners)
        flat, _, clock = server.pull()
        for learner in range(learners):
            for p, w in zip(params, server.param_layout.unpack(flat)):
                p.data.copy_(w)
            model.zero_grad()
            rows = torch.arange(batch.start, batch.stop)[learner::learners]
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            server.push(
                Push(
                    learner,
                    0,
                    server.grad_layouts[0].pack([p.grad for p in params]),
                    torch.tensor([True, True]),
                    clock,
                    [{"lr": 0.1, "momentum": 0.9}],
                    [],
                )
            )
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x[batch]), y[batch]).backward()
        ref_opt.step()
    assert server.clock == 4
    for theirs, mine in zip(server.params, reference.parameters()):
        torch.testing.assert_close(theirs, mine.detach(), rtol=0, atol=1e-5)


def test_flat_layout_groups_by_dtype_and_round_trips():
    tensors = [torch.randn(2, 3), torch.arange(4), torch.randn(5)]
    layout = FlatLayout(tensors)
    flats = layout.pack(tensors)
    assert [f.dtype for f in flats] == [torch.float32, torch.int64] and flats[0].numel() == 11
    for a, b in zip(layout.unpack(flats), tensors):
        assert torch.equal(a, b)


def test_stats_round_trip_and_summary():
    stats = Stats(clock=3, gradients=5, dropped=1, rejected=0, staleness={0: 2, 2: 2})
    assert Stats.from_dict(stats.to_dict()) == stats
    assert stats.mean_staleness == 1.0 and stats.max_staleness == 2
