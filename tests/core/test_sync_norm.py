"""``syncnorm``: a stale update clipped by norm is clipped by the norm of the synchronous update it stands for,
estimated by a running mean of the updates' gradients (:class:`lightning_rudra.core.clipping.SyncNorm`)."""

import math

import pytest
import torch

from lightning_rudra.core.clipping import Clipping, SyncNorm, norm64
from lightning_rudra.core.errors import ConfigurationError
from lightning_rudra.core.optimizers import OptimizerSpec
from lightning_rudra.core.protocol import ProtocolConfig, Server
from lightning_rudra.core.update import Push
from tests.core.test_clipping import one_weight_server, push


def with_grad(*values: list[float]) -> list[torch.Tensor]:
    params = [torch.zeros(len(v)) for v in values]
    for p, v in zip(params, values):
        p.grad = torch.tensor(v)
    return params


def fold(sync: SyncNorm, params: list[torch.Tensor], alpha: float) -> float:
    """As ``clip`` asks: with the norm of the gradients."""
    return sync.ratio(params, alpha, norm64([p.grad for p in params]))


def test_the_ratio_is_of_the_running_mean_to_the_gradient_and_starts_at_one():
    sync = SyncNorm()
    assert fold(sync, with_grad([3.0], [4.0]), 0.5) == 1.0  # the first gradient is the mean
    # mean: 0.5 [3, 4] + 0.5 [-3, 4] = [0, 4]; |g| = 5
    assert fold(sync, with_grad([-3.0], [4.0]), 0.5) == pytest.approx(4 / 5)
    assert [m.tolist() for m in sync.means.values()] == [[0.0], [4.0]]


@pytest.mark.parametrize("bad", [0.0, math.inf, math.nan])
def test_a_zero_or_non_finite_gradient_is_not_folded_in(bad):
    sync = SyncNorm()
    fold(sync, with_grad([3.0, 4.0]), 0.5)
    assert fold(sync, with_grad([bad, 0.0]), 0.5) == 1.0
    assert sync.means[0].tolist() == [3.0, 4.0]


def test_a_parameter_without_a_gradient_keeps_its_mean_and_is_left_out_of_the_norms():
    sync = SyncNorm()
    fold(sync, with_grad([1.0], [10.0]), 0.5)
    params = with_grad([3.0], [0.0])
    params[1].grad = None
    assert fold(sync, params, 0.5) == pytest.approx(2 / 3)  # mean [2] of the first parameter, |g| = 3
    assert sync.means[1].tolist() == [10.0]


def test_an_async_update_is_clipped_by_the_running_means_norm():
    rule, old = (
        one_weight_server("async", 2, compensation="momentum+syncnorm"),
        one_weight_server("async", 2, compensation="momentum"),
    )
    for s in (rule, old):
        push(s, 0, [3.0, 4.0], 0, Clipping(1.0))  # the first: by its own norm, [0.6, 0.8], the rate halved (c/λ)
        assert s.params[0].tolist() == pytest.approx([-0.03, -0.04])
        push(s, 1, [-3.0, 4.0], 0, Clipping(1.0))  # σ = 1
    # α = 2c/(λ + c) = 2/3: mean [-1, 4], norm √17, not the gradient's 5; then the rate: 0.1 · 1/2 (c/λ, 1/(σ + 1))
    factor = 1 / math.sqrt(17)
    assert rule.params[0].tolist() == pytest.approx([-0.03 + 0.05 * 3 * factor, -0.04 - 0.05 * 4 * factor])
    assert old.params[0].tolist() == pytest.approx([-0.03 + 0.05 * 0.6, -0.04 - 0.05 * 0.8], abs=1e-7)


def moved(s: Server, learner: int, grad, timestamp: int) -> float:
    before = s.params[0].clone()
    result = push(s, learner, grad, timestamp, Clipping(1.0))
    assert result.update.staleness == (s.clock - 1 - timestamp,)
    return (before - s.params[0]).norm().item()


def test_a_gradient_far_above_the_mean_moves_at_most_the_synchronous_limit():
    s = one_weight_server("async", 4, compensation="momentum+syncnorm")
    for t in range(20):
        push(s, t % 4, [0.01, 0.0], max(0, t - 3), Clipping(1.0))  # σ = 3 once the clock is at 3
    # its rate 0.1 is scaled by 1/4 (c/λ, 1/(σ + 1)) and the mean holds α = 2/5 of it: (λ + c)/(2λ) = 5/8 of the
    # synchronous update's step at the limit (0.1 · 1.0), at most; by its own norm it would have moved 1/4 of it
    assert 0.1 / 4 < moved(s, 1, [1e6, 0.0], 17) <= 0.1 * 5 / 8 + 1e-7


@pytest.mark.parametrize("flip", [1.0, 1.49, 1.5])
def test_gradients_that_flip_sign_are_still_clipped_to_the_synchronous_limit(flip):
    """A mean that cancels (g, then -1.5 g: α = 2/5 of it cancels the 3/5 of the first) would take the clipping
    off; the ratio is held at α or more."""
    s = one_weight_server("async", 4, compensation="momentum+syncnorm")
    moved(s, 0, [-1e6, 0.0], 0)
    assert moved(s, 1, [flip * 1e6, 0.0], 0) <= 0.1 * 5 / 8 + 1e-7


@pytest.mark.parametrize("dtype, spike", [(torch.float64, 1e39), (torch.float32, 1e30), (torch.float32, 1e3)])
def test_after_a_spike_the_next_updates_move_as_far_as_their_own_norm_lets_them(dtype, spike):
    """A spike (a float64 one beyond float32's range too) leaves its share in the mean: the next updates are then
    clipped by their own norm, as without the rule, not held back by the spike's share for hundreds of updates."""

    def steps(compensation: str) -> list[float]:
        w = torch.zeros(2, dtype=dtype)
        spec = OptimizerSpec.from_optimizer(torch.optim.SGD([w], lr=0.1), [w])
        s = Server(ProtocolConfig(16, "async", compensation=compensation), [w], [], [spec])
        moved = []
        for t, grad in enumerate([[spike, 0.0]] + [[1.0, 1.0]] * 5):  # σ = 0: the clip rule lets the spike through
            before = s.params[0].clone()
            s.push(
                Push(t % 16, 0, [torch.tensor(grad, dtype=dtype)], torch.tensor([True]), t, [{"lr": 0.1}], [],
                     clipping=(Clipping(1.0),))
            )  # fmt: skip
            moved.append((before - s.params[0]).norm().item())
        return moved

    rule, old = steps("momentum+clip+syncnorm"), steps("momentum+clip")
    assert rule[0] <= 0.1 * 17 / 32 + 1e-9  # the spike itself: at most (λ + c)/(2λ) of the limit's step
    assert rule[1:] == pytest.approx(old[1:]) and min(old[1:]) > 1e-3


def test_softsync_folds_each_update_of_c_gradients_with_its_own_weight():
    # n = 1 would make c = 4 = λ: untouched; n = 2: c = 2
    w = torch.zeros(2)
    spec = OptimizerSpec.from_optimizer(torch.optim.SGD([w], lr=0.1), [w])
    s = Server(ProtocolConfig(4, "softsync", n=2, compensation="momentum+syncnorm"), [w], [], [spec])
    push(s, 0, [3.0, 4.0], 0, Clipping(1.0))
    push(s, 1, [3.0, 4.0], 0, Clipping(1.0))
    push(s, 2, [-3.0, 4.0], 1, Clipping(1.0))
    push(s, 3, [-3.0, 4.0], 1, Clipping(1.0))
    # α = 2c/(λ + c) = 2/3: the mean of [3, 4] and [-3, 4] as the second update's gradient is folded in
    assert s.sync_norms[0].means[0].tolist() == pytest.approx([-1.0, 4.0])


def test_one_learner_clipping_by_value_and_no_clipping_are_unchanged():
    pushes = [([3.0, 4.0], Clipping(1.0)), ([-3.0, 4.0], Clipping(1.0)), ([5.0, -2.0], Clipping(0.5, "value"))]
    rule, old = (
        one_weight_server("async", 1, compensation="momentum+syncnorm"),
        one_weight_server("async", 1, compensation="momentum"),
    )
    for s in (rule, old):
        for step, (grad, clipping) in enumerate(pushes):
            push(s, 0, grad, step, clipping)
    assert torch.equal(rule.params[0], old.params[0]) and not rule.sync_norms[0].means  # never asked
    rule, old = (
        one_weight_server("async", 2, compensation="momentum+syncnorm"),
        one_weight_server("async", 2, compensation="momentum"),
    )
    for s in (rule, old):
        for step, (grad, clipping) in enumerate(pushes):
            push(s, step % 2, grad, step, *([clipping] if clipping.algorithm == "value" else []))
    assert torch.equal(rule.params[0], old.params[0])


def test_syncnorm_without_momentum_is_refused_by_name():
    with pytest.raises(ConfigurationError, match="'syncnorm' clips a stale update .* Use it with 'momentum'"):
        one_weight_server("async", 2, compensation="clip+syncnorm")


def test_over_two_servers_each_scales_the_learners_norm_by_its_parts_ratio():
    """Learner 1's gradient [[-3, 4], [0, 12]] over two servers, clipped to 1 by its norm over both parts: each server
    scales that norm by its own part's |m|/|g|."""
    servers = []
    for first in ([0.0, 0.0], [0.0, 0.0]):
        w = torch.tensor(first)
        spec = OptimizerSpec.from_optimizer(torch.optim.SGD([w], lr=1.0), [w])
        servers.append(Server(ProtocolConfig(2, "async", compensation="momentum+syncnorm"), [w], [], [spec]))
    parts = ([[3.0, 4.0], [0.0, 12.0]], [[-3.0, 4.0], [0.0, 12.0]])
    for learner, grads in enumerate(parts):
        norm = math.sqrt(sum(x * x for part in grads for x in part))
        for s, grad in zip(servers, grads):
            push(s, learner, grad, 0, Clipping(1.0, servers=(0, 1), norm=norm))
    norm = 13.0
    first = [-0.05 * 3 / norm, -0.05 * 4 / norm]  # learner 0's: the rate 0.1 · 1/2, its own norm 13
    ratio = math.sqrt(17) / 5  # server 0's part: mean [-1, 4] against [-3, 4]; server 1's: 1
    expected0 = [first[0] + 0.05 * 3 / (norm * ratio), first[1] - 0.05 * 4 / (norm * ratio)]
    assert servers[0].params[0].tolist() == pytest.approx(expected0)
    assert servers[1].params[0].tolist() == pytest.approx([0.0, -0.05 * 12 / norm * 2])
