"""Stale Synchronous Parallel (``on_stale="block"``, :mod:`lightning_rudra.core.ssp`): scripted pushes into the
in-process server; σ counted in the histogram, held pushes and when they go, weights by hand."""

import random

import pytest
import torch

from lightning_rudra.core.config import ProtocolConfig, min_blocking_staleness
from lightning_rudra.core.errors import ConfigurationError
from lightning_rudra.core.optimizers import OptimizerSpec
from lightning_rudra.core.protocol import Server
from tests.core.test_protocol import push, weights


def make_server(protocol="async", learners=2, max_staleness=1, n=1, on_stale="block"):
    w = torch.zeros(2)
    opt = torch.optim.SGD([w], lr=0.1)
    config = ProtocolConfig(learners, protocol, n, max_staleness=max_staleness, on_stale=on_stale)
    return Server(config, [w], [], [OptimizerSpec.from_optimizer(opt, [w])])


def test_a_push_that_would_make_the_lagging_learners_gradient_too_stale_is_held_until_it_comes():
    server = make_server("async", learners=2, max_staleness=1)
    assert push(server, 0, [1.0, 0.0], 0).status == "accepted"  # clock 1: learner 1's gradient (clock 0) σ 1 at most
    held = push(server, 0, [2.0, 0.0], 1)  # clock 2 would make learner 1's σ 2
    assert held.status == "held" and not held.closed and held.update is None
    assert server.clock == 1 and weights(server) == pytest.approx([-0.1, 0.0])  # nothing of it applied
    assert server.release() == []  # learner 1 has not pushed yet
    lagging = push(server, 1, [0.0, 4.0], 0)
    assert lagging.status == "accepted" and lagging.staleness == 1
    [(released, result)] = server.release()
    assert released.learner == 0 and result.status == "accepted" and result.staleness == 1  # from clock 1 at 2
    assert server.clock == 3 and weights(server) == pytest.approx([-0.3, -0.4])
    assert server.stats.staleness == {0: 1, 1: 2} and server.stats.dropped == 0 and server.stats.gradients == 3


def test_drop_is_unchanged_it_holds_nothing_and_drops_what_block_would_hold():
    server = make_server("async", learners=2, max_staleness=1, on_stale="drop")
    push(server, 0, [1.0, 0.0], 0)
    assert push(server, 0, [2.0, 0.0], 1).status == "accepted"
    assert push(server, 1, [0.0, 4.0], 0).status == "dropped"  # σ = 2
    assert server.gate is None and server.release() == []
    assert server.stats.dropped == 1 and server.stats.staleness == {0: 2}


def run(server, speeds, pushes, seed):
    """Learners that push at random, learner i ``speeds[i]`` times as often as one of speed 1, each from the clock of
    its last reply; a held learner waits for its reply. Fails if every learner waits (a deadlock)."""
    rng = random.Random(seed)
    handed = {learner: server.clock for learner in range(len(speeds))}
    waiting: set[int] = set()
    for _ in range(pushes):
        ready = sorted(server.active - waiting)
        assert ready, f"every learner waits: {sorted(waiting)} held"
        learner = rng.choices(ready, weights=[speeds[i] for i in ready])[0]
        result = push(server, learner, [1.0, 1.0], handed[learner])
        released = server.release()
        if result.status == "held":
            waiting.add(learner)
        else:
            handed[learner] = server.clock  # the reply's weights: after the pushes it let go
        for pushed, _ in released:
            waiting.discard(pushed.learner)
            handed[pushed.learner] = server.clock
    return waiting


CASES = [("async", 2, 1, 1), ("async", 3, 1, 2), ("async", 4, 1, 3), ("softsync", 4, 1, 1), ("softsync", 4, 2, 2)]
CASES += [("softsync", 5, 2, 2), ("softsync", 6, 3, 3)]


@pytest.mark.parametrize("protocol, learners, n, bound", CASES)
def test_sigma_never_exceeds_the_bound_nothing_is_dropped_and_nobody_waits_for_ever(protocol, learners, n, bound):
    assert min_blocking_staleness(protocol, n, learners) == bound
    for seed in range(10):
        server = make_server(protocol, learners, bound, n)
        speeds = [0.2] + [1.0] * (learners - 1)  # learner 0 lags
        run(server, speeds, 300, seed)
        assert max(server.stats.staleness) <= bound, server.stats.staleness
        assert server.stats.dropped == 0 and server.stats.held > 0
    # the same script with drop goes over the bound (and drops)
    dropping = make_server(protocol, learners, bound, n, on_stale="drop")
    run(dropping, speeds, 300, 0)
    assert dropping.stats.dropped > 0


@pytest.mark.parametrize("protocol, learners, n, bound", CASES)
def test_nobody_is_held_when_nobody_lags(protocol, learners, n, bound):
    # the learners in turn, each from the weights of its last reply: σ as the protocol makes it, within the bound
    server = make_server(protocol, learners, bound, n)
    handed = [0] * learners
    for step in range(10 * learners):
        learner = step % learners
        assert push(server, learner, [1.0, 1.0], handed[learner]).status != "held"
        handed[learner] = server.clock
    assert server.stats.held == 0 and max(server.stats.staleness) <= bound


def test_softsync_holds_the_push_that_would_close_an_update_too_early():
    # 1-softsync, λ = 2, c = 2, s = 1: learner 0 alone would close updates with its own gradients
    server = make_server("softsync", learners=2, max_staleness=1)
    assert push(server, 0, [1.0, 1.0], 0).status == "accepted"  # waits for a second gradient
    assert push(server, 0, [1.0, 1.0], 0).status == "accepted"  # closes clock 1: learner 1's gradient goes in next
    assert server.clock == 1
    assert push(server, 0, [1.0, 1.0], 1).status == "accepted"  # joins the update learner 1's goes into
    assert push(server, 0, [1.0, 1.0], 1).status == "held"  # would close clock 2: learner 1's σ would be 2
    assert push(server, 1, [1.0, 1.0], 0).closed  # σ 1, closes clock 2
    [(released, result)] = server.release()
    assert released.learner == 0 and result.staleness == 1 and server.clock == 2
    assert server.stats.staleness == {0: 3, 1: 2}


def test_a_held_push_goes_when_the_lagging_learner_is_lost_and_a_lost_learners_held_push_is_not_applied():
    server = make_server("async", learners=3, max_staleness=2)
    push(server, 0, [1.0, 1.0], 0)
    # clock 2 would leave learners 1 and 2 (clock 0) to be applied at 2 and 3: σ 3 for one of them
    assert push(server, 0, [1.0, 1.0], 1).status == "held"
    assert push(server, 1, [1.0, 1.0], 0).status == "accepted"  # σ 1, clock 2: then learner 2's (σ 2) first
    assert server.release() == []
    assert push(server, 1, [1.0, 1.0], 2).status == "held"
    server.remove(2)  # learner 2 is lost: nobody waits for it
    released = server.release()
    assert [p.learner for p, _ in released] == [0, 1] and server.clock == 4
    assert max(server.stats.staleness) <= 2 and server.stats.dropped == 0
    # a lost learner's own held push goes with it
    server = make_server("async", learners=2, max_staleness=1)
    push(server, 0, [1.0, 1.0], 0)
    assert push(server, 0, [1.0, 1.0], 1).status == "held"
    server.remove(0)
    assert server.release() == [] and server.clock == 1 and server.gate is not None and server.gate.held == []


def test_a_held_push_goes_when_the_lagging_learner_finishes_or_waits_at_a_collective():
    for leave in ("finish", "collective"):
        server = make_server("async", learners=2, max_staleness=1)
        push(server, 0, [1.0, 1.0], 0)
        assert push(server, 0, [1.0, 1.0], 1).status == "held"
        if leave == "finish":
            server.finish(1)
            released = server.release()
        else:
            released = server.release(away={1})
        assert [p.learner for p, _ in released] == [0] and server.clock == 2, leave


def test_a_learner_with_a_held_push_cannot_push_again():
    server = make_server("async", learners=2, max_staleness=1)
    push(server, 0, [1.0, 1.0], 0)
    push(server, 0, [1.0, 1.0], 1)
    with pytest.raises(ValueError, match="learner 0 refused: its previous push is held back"):
        push(server, 0, [1.0, 1.0], 1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(on_stale="wait", max_staleness=1), "on_stale='wait' is not supported: expected one of 'drop', 'block'"),
        (dict(on_stale="block"), "on_stale='block' needs a bound to keep: max_staleness=None"),
        (dict(on_stale="block", max_staleness=1, protocol="hardsync"), "nothing to block under protocol='hardsync'"),
        (dict(on_stale="block", max_staleness=3, protocol="async", overlap=True), "not available with overlap=True"),
        (
            dict(on_stale="block", max_staleness=2, protocol="async"),
            r"max_staleness=2 with on_stale='block' cannot be kept by async with λ=4 learners.*max_staleness >= 3",
        ),
        (
            dict(on_stale="block", max_staleness=1, protocol="softsync", n=2),
            r"cannot be kept by 2-softsync with λ=4 learners.*Use max_staleness >= 2",
        ),
    ],
)
def test_block_is_refused_where_it_cannot_keep_the_bound(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        ProtocolConfig(num_learners=4, **kwargs)


def test_block_is_refused_with_several_optimizers_when_the_server_gets_the_model():
    params = [torch.zeros(1), torch.zeros(1)]
    specs = [OptimizerSpec.from_optimizer(torch.optim.SGD([p], lr=0.1), params) for p in params]
    config = ProtocolConfig(2, "async", max_staleness=1, on_stale="block")
    with pytest.raises(ConfigurationError, match="on_stale='block' is not available with 2 optimizers"):
        Server(config, params, [], specs)
