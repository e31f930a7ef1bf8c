"""Staleness compensation on scripted pushes: each rule's update by hand, the identity where nothing is stale,
the rules' state beside the optimizer's and in its checkpoint, and the refusals."""

import copy

import pytest
import torch

from lightning_rudra.core import compensation as rules_module
from lightning_rudra.core.compensation import (
    CLIP_WARMUP,
    RULES_STATE,
    check_optimizer,
    parse_compensation,
    staleness_options,
)
from lightning_rudra.core.optimizers import OptimizerSpec
from lightning_rudra.core.protocol import ProtocolConfig, Server
from lightning_rudra.core.stats import Stats
from lightning_rudra.core.update import Push


def scalar_server(compensation, protocol="async", learners=2, momentum=0.0, optimizer=torch.optim.SGD, n=1, **options):
    w = torch.ones(1)
    opt = optimizer([w], lr=0.1, **({"momentum": momentum} if optimizer is torch.optim.SGD else {}), **options)
    config = ProtocolConfig(learners, protocol, n=n, compensation=compensation)
    return Server(config, [w], [], [OptimizerSpec.from_optimizer(opt, [w])]), opt


def push(server, opt, learner, grad, timestamp):
    return server.push(
        Push(
            learner,
            0,
            [torch.tensor([grad])],
            torch.tensor([True]),
            timestamp,
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            [],
        )
    )


def weight(server):
    return server.params[0].item()


def test_momentum_scales_the_rate_by_c_over_lambda_then_trades_momentum_for_a_stable_step_once_stale():
    server, opt = scalar_server("momentum", momentum=0.9)
    push(server, opt, 0, 1.0, 0)  # σ = 0, ⟨σ⟩ = 0: lr 0.1 · c/λ = 0.05, momentum 0.9
    assert weight(server) == pytest.approx(0.95)
    push(server, opt, 1, 2.0, 0)  # σ = 1, ⟨σ⟩ = 0.5: momentum 0, step 0.1 / (1 - 0.9) · min(1/2, 1/(σ + 1))
    assert weight(server) == pytest.approx(0.95 - 0.5 * 2.0)
    push(server, opt, 0, 1.0, 0)  # σ = 2: step 1 · min(1/2, 1/3)
    assert weight(server) == pytest.approx(-0.05 - 1 / 3)
    push(server, opt, 1, 1.0, 3)  # σ = 0 (fresh), ⟨σ⟩ = 0.75: the update's own σ bounds it, step 1 · 1/2
    assert weight(server) == pytest.approx(-0.05 - 1 / 3 - 1 / 2)
    assert server.optimizers[0].param_groups[0]["momentum"] == 0.0 and opt.param_groups[0]["momentum"] == 0.9


def test_momentum_on_adam_keeps_its_moments_and_scales_the_rate_by_c_over_lambda():
    server, opt = scalar_server("momentum", optimizer=torch.optim.Adam, betas=(0.9, 0.99))
    for timestamp in (0, 0, 0):
        push(server, opt, 0, 1.0, timestamp)
    group = server.optimizers[0].param_groups[0]
    # async (c = 1): ⟨σ⟩ = 1 but no cap, c/λ only
    assert group["betas"] == (0.9, 0.99) and group["lr"] == pytest.approx(0.1 / 2)


def test_momentum_caps_an_sgd_softsync_update_by_the_mean_staleness_of_its_own_gradients():
    server, opt = scalar_server("momentum", "softsync", learners=8, n=2)  # c = 4, c/λ = 1/2
    for clock in range(3):  # fresh updates: w = 1 - 3 · 0.1 · 1/2
        for learner in range(4):
            push(server, opt, learner, 1.0, clock)
    assert weight(server) == pytest.approx(0.85)
    for learner, timestamp in ((4, 0), (5, 0), (6, 0), (7, 3)):  # σ = 3, 3, 3, 0: their mean 2.25 (not 3, not 0)
        push(server, opt, learner, 1.0, timestamp)
    assert server.last_updates[0].rule_scale == pytest.approx(1 / 3.25)
    assert weight(server) == pytest.approx(0.85 - 0.1 / 3.25)


def test_momentum_caps_an_adaptive_softsync_update_at_one_over_two_mean_staleness_plus_one():
    server, opt = scalar_server("momentum", "softsync", learners=4, n=2, optimizer=torch.optim.Adam)
    group = server.optimizers[0].param_groups[0]
    rates = []
    for learner in range(6):  # c = 2: updates after gradients of σ = 0, 0 | 1, 1 | 2, 2
        push(server, opt, learner % 4, 1.0, 0)
        rates.append(group["lr"])
    # ⟨σ⟩ = 0: c/λ; 0.5: min(1/2, 1/2); 1: min(1/2, 1/3)
    assert rates[1::2] == pytest.approx([0.1 / 2, 0.1 / 2, 0.1 / 3]), rates


def test_dc_adds_the_taylor_term_to_a_stale_gradient():
    server, opt = scalar_server("dc")
    push(server, opt, 0, 1.0, 0)  # fresh: w = 1 - 0.1
    assert weight(server) == pytest.approx(0.9)
    push(server, opt, 1, 2.0, 0)  # from w = 1, now 0.9: g + 0.2 · g² / sqrt(g²) · (0.9 - 1) = 2 - 0.04
    assert weight(server) == pytest.approx(0.9 - 0.1 * 1.96)
    assert server.optimizer_state(0)["state"][RULES_STATE][0]["dc_mean_square"].item() == pytest.approx(4.0)


def test_gap_divides_by_the_gap_in_units_of_the_mean_step():
    server, opt = scalar_server("gap")
    push(server, opt, 0, 1.0, 0)  # w = 0.9, mean step 0.1
    push(server, opt, 1, 1.0, 0)  # gap |0.9 - 1| / 0.1 = 1: unchanged, w = 0.8; mean step stays 0.1
    assert weight(server) == pytest.approx(0.8)
    push(server, opt, 0, 2.0, 0)  # gap |0.8 - 1| / 0.1 = 2: the gradient halved
    assert weight(server) == pytest.approx(0.7)


def test_clip_scales_a_stale_gradient_down_to_the_median_norm_of_the_recent_stale_ones():
    server, opt = scalar_server("clip")
    push(server, opt, 0, 1.0, 0)  # fresh (σ = 0): never clipped, never counted
    assert weight(server) == pytest.approx(0.9) and not server.norm_windows[0].norms
    expected = 0.9
    for k in range(CLIP_WARMUP - 1):  # stale (from clock 0), norms 1..9: fewer than the warm-up, none clipped
        push(server, opt, 1, float(k + 1), 0)
        expected -= 0.1 * (k + 1)
    assert weight(server) == pytest.approx(expected)
    push(server, opt, 0, -100.0, 0)  # the 10th: the median of 1..9 and 100 (its upper one, 6) caps it
    assert weight(server) == pytest.approx(expected + 0.1 * 6.0)
    push(server, opt, 0, 2.0, 0)  # under the median: as it came
    assert weight(server) == pytest.approx(expected + 0.6 - 0.2)
    assert server.stats.clipped == 1 and server.stats.to_dict()["clipped"] == 1


def test_clip_leaves_alone_what_says_nothing_of_a_steps_size_and_clips_what_would_overflow_float32_norms():
    window = rules_module.NormWindow()
    assert window.clip([]) == 1.0  # a server holding none of the optimizer's gradients
    for _ in range(CLIP_WARMUP + 5):
        assert window.clip([torch.zeros(3)]) == 1.0  # zero gradients: not recorded, the median never 0
    assert not window.norms
    for norm in range(1, CLIP_WARMUP + 1):
        window.clip([torch.tensor([float(norm)])])
    huge = [torch.full((4,), 3e19), torch.full((4,), 3e19)]  # finite, but its float32 norm is inf
    assert window.clip(huge) < 1e-18 and torch.isfinite(torch.cat(huge)).all()
    assert torch.linalg.vector_norm(torch.cat(huge).double()).item() == pytest.approx(6.0, rel=1e-5)


def test_a_server_holding_none_of_an_optimizers_parameters_takes_stale_updates_under_the_default():
    w = torch.zeros(2)
    spec = OptimizerSpec(torch.optim.SGD, [([], {"lr": 0.1})])  # the optimizer's parameters are on another server
    server = Server(ProtocolConfig(2, "async", compensation="momentum+clip"), [w], [], [spec])
    for step in range(CLIP_WARMUP + 3):  # every push after the first is stale: empty updates, never a crash
        push = Push(step % 2, 0, [], torch.zeros(0, dtype=torch.bool), 0, [{"lr": 0.1, "momentum": 0.0}], [])
        assert server.push(push).update is not None
    assert server.clock == CLIP_WARMUP + 3 and server.stats.max_staleness > 0 and w.tolist() == [0.0, 0.0]


def test_the_clip_window_keeps_the_last_norms_sorted_and_leaves_non_finite_gradients_to_their_rule(monkeypatch):
    monkeypatch.setattr(rules_module, "CLIP_WINDOW", 4)
    monkeypatch.setattr(rules_module, "CLIP_WARMUP", 2)
    window = rules_module.NormWindow()
    grads = lambda norm: [torch.tensor([0.6 * norm]), torch.tensor([0.8 * norm])]  # noqa: E731
    assert window.clip(grads(5.0)) == 1.0  # warming up
    assert window.clip(grads(1.0)) == 1.0  # under the median of (1, 5): 5
    assert window.clip(grads(float("nan"))) == 1.0 and len(window.norms) == 2
    for norm in (2.0, 3.0, 4.0):  # 5 leaves the window: (1, 2, 3, 4)
        window.clip(grads(norm))
    assert window.ordered == pytest.approx([1.0, 2.0, 3.0, 4.0])
    g = grads(10.0)
    assert window.clip(g) == pytest.approx(4.0 / 10.0)  # median of (2, 3, 4, 10) is 4
    assert torch.linalg.vector_norm(torch.cat(g)).item() == pytest.approx(4.0)


@pytest.mark.parametrize("compensation", ["momentum", "dc", "gap", "clip", "momentum+dc+gap+clip"])
def test_one_async_learner_is_plain_sgd_under_every_rule(compensation):
    server, opt = scalar_server(compensation, learners=1, momentum=0.9, nesterov=True)
    w = torch.ones(1, requires_grad=True)
    plain = torch.optim.SGD([w], lr=0.1, momentum=0.9, nesterov=True)
    for step, grad in enumerate([1.0, -2.0, 0.5, 3.0]):
        push(server, opt, 0, grad, step)
        w.grad = torch.tensor([grad])
        plain.step()
        assert weight(server) == w.item()


def test_hardsync_is_never_changed():
    updated = []
    for compensation in ("none", "momentum+dc+gap+clip"):
        server, opt = scalar_server(compensation, protocol="hardsync", momentum=0.9)
        for k in range(3):
            push(server, opt, 0, 1.0 + k, k)
            push(server, opt, 1, -0.5 * k, k)
        updated.append(weight(server))
    assert updated[0] == updated[1]


# the optimizers whose state torch creates at a parameter's first gradient: an entry of another's keys broke them
LAZY_STATE = [
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.RMSprop,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adamax,
    torch.optim.Adadelta,
]


def two_parameter_server(compensation, optimizer, learners=2):
    params = [torch.ones(2), torch.ones(3)]
    opt = optimizer(params, lr=0.1)
    config = ProtocolConfig(learners, "async", compensation=compensation)
    return Server(config, params, [], [OptimizerSpec.from_optimizer(opt, params)]), opt


def push_each(server, opt, learner, grads, timestamp):
    """A push of one gradient per parameter (None: that parameter has none)."""
    packed = server.grad_layouts[0].pack(
        [torch.zeros(p.shape) if g is None else g for p, g in zip(server.params, grads)]
    )
    has_grad = torch.tensor([g is not None for g in grads])
    hparams = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return server.push(Push(learner, 0, packed, has_grad, timestamp, hparams, []))


G0, G1 = torch.full((2,), 0.5), torch.full((3,), -1.0)


@pytest.mark.parametrize("compensation", ["dc", "gap", "dc+gap"])
@pytest.mark.parametrize("optimizer", LAZY_STATE, ids=lambda cls: cls.__name__)
def test_a_parameter_whose_first_gradient_comes_late_steps_as_its_optimizer_would(optimizer, compensation):
    server, opt = two_parameter_server(compensation, optimizer)
    push_each(server, opt, 0, [G0, None], 0)  # the first update: parameter 1 has no gradient yet
    push_each(server, opt, 1, [G0, G1], 0)  # σ = 1: compensated; parameter 1's first gradient
    # parameter 1 had not moved since the weights of its gradient: no rule changes it, it steps as alone
    w = torch.ones(3)
    alone = optimizer([w], lr=0.1)
    w.grad = G1.clone()
    alone.step()
    torch.testing.assert_close(server.params[1], w, rtol=0, atol=1e-7)
    for p in server.params:  # the optimizer's state holds its own keys only
        assert set(server.optimizers[0].state[p]) == set(alone.state[w])
    push_each(server, opt, 0, [G0, G1], 1)  # and it goes on, compensated
    assert server.clock == 3 and all(torch.isfinite(p).all() for p in server.params)


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam], ids=lambda cls: cls.__name__)
def test_the_rules_state_is_kept_beside_the_optimizers_and_resumes_exactly(optimizer):
    server, opt = two_parameter_server("dc+gap", optimizer)
    for learner, grads, timestamp in ((0, [G0, None], 0), (1, [G0, G1], 0), (0, [G0, G1], 1)):
        push_each(server, opt, learner, grads, timestamp)
    saved = copy.deepcopy(server.optimizer_state(0))
    own = {"step", "exp_avg", "exp_avg_sq", "momentum_buffer"}  # SGD's and Adam's keys
    assert all(set(entry) <= own for key, entry in saved["state"].items() if isinstance(key, int))
    rules = saved["state"][RULES_STATE]
    assert set(rules) == {0, 1} and set(rules[1]) == {"dc_mean_square", "gap_step"}

    def resumed(state):
        params = [p.clone() for p in server.params]
        specs = [OptimizerSpec.from_optimizer(optimizer(params, lr=0.1), params)]
        again = Server(server.config, params, [], specs, Stats.from_dict(server.stats.to_dict()))
        again.load_optimizer_state(0, copy.deepcopy(state))
        return again

    without_rules = {**saved, "state": {k: v for k, v in saved["state"].items() if k != RULES_STATE}}
    servers = [server, resumed(saved), resumed(without_rules)]
    for s in servers:  # every learner goes on from the restored weights
        clock = s.clock
        push_each(s, opt, 0, [G0, G1], clock)
        push_each(s, opt, 1, [2 * G0, -G1], clock)
        push_each(s, opt, 0, [-G0, G1], clock + 1)
    for p, q in zip(servers[0].params, servers[1].params):
        assert torch.equal(p, q)
    assert not torch.equal(servers[0].params[0], servers[2].params[0])  # the rules' state made a difference


def test_a_checkpoint_with_the_rules_state_in_the_optimizers_entries_still_loads():
    """As the first releases wrote it: the running means in the entries of the optimizer's parameters."""
    server, opt = two_parameter_server("dc+gap", torch.optim.Adam)
    old = {
        "state": {
            0: {"step": torch.tensor(1.0), "exp_avg": G0.clone(), "exp_avg_sq": G0 * G0, "rudra_gap_step": G0.abs()},
            1: {"rudra_dc_mean_square": G1 * G1},  # no gradient yet: Adam's own keys come with its first
        },
        "param_groups": opt.state_dict()["param_groups"],
    }
    server.load_optimizer_state(0, old)
    assert set(server.optimizers[0].state[server.params[0]]) == {"step", "exp_avg", "exp_avg_sq"}
    assert server.params[1] not in server.optimizers[0].state
    saved = server.optimizer_state(0)["state"][RULES_STATE]
    assert torch.equal(saved[0]["gap_step"], G0.abs()) and torch.equal(saved[1]["dc_mean_square"], G1 * G1)
    push_each(server, opt, 0, [G0, G1], 0)  # parameter 1's first gradient: Adam creates its state
    with pytest.raises(ValueError, match=r"names parameter 2 of an optimizer of 2 parameters"):
        server.load_optimizer_state(0, {**old, "state": {RULES_STATE: {2: {"gap_step": G0}}}})


def test_the_rate_reported_is_the_rate_the_server_applied_after_the_rule():
    server, opt = scalar_server("momentum", momentum=0.9)
    first = push(server, opt, 0, 1.0, 0).update  # σ = 0: lr · c/λ = 0.05, momentum kept
    assert first.lr_scale == pytest.approx(0.5)
    second = push(server, opt, 1, 2.0, 0).update  # σ = 1: momentum off, step 0.1 / (1 - 0.9) · min(1/2, 1/2)
    applied = server.optimizers[0].param_groups[0]["lr"]
    assert applied == pytest.approx(0.5) and second.lr_scale * 0.1 == pytest.approx(applied)


def test_defaults_and_refusals():
    assert staleness_options(None, None) == ("none", "momentum+clip+syncnorm+dana")
    assert staleness_options("mean", None) == ("mean", "none")
    assert staleness_options("none", None) == ("none", "none")  # a config that names its rule keeps it
    assert parse_compensation("none") == () and parse_compensation("gap+momentum") == ("gap", "momentum")
    with pytest.raises(ValueError, match=r"compensation='dc\+dc' is not supported"):
        parse_compensation("dc+dc")
    with pytest.raises(
        ValueError,
        match=r"compensation 'momentum' scales the learning rate, which optimizer 0 "
        r"\(Rprop\) does not",
    ):
        check_optimizer(("momentum",), torch.optim.Rprop, "optimizer 0 (Rprop)")
    check_optimizer(("dc",), torch.optim.Rprop, "optimizer 0 (Rprop)")
    with pytest.raises(ValueError, match="lr_modulation='per_gradient' and compensation='momentum' both scale"):
        ProtocolConfig(2, "async", lr_modulation="per_gradient", compensation="momentum")


def test_the_cost_benchmark_times_every_rule():
    from benchmarks.compensation import RULES, markdown, measure

    result = measure(size=1000, pushes=2, rounds=1)
    assert set(result["median_push_ms"]) == set(RULES) and all(ms > 0 for ms in result["median_push_ms"].values())
    assert "| momentum+dc |" in markdown(result)
