"""The engine over real RPC: learner processes, a server process, no Lightning."""

import collections
import os

import pytest
import torch

from lightning_rudra.core.epoch import EpochPlan
from lightning_rudra.core.lookahead import StepAhead
from lightning_rudra.core.optimizers import OptimizerSpec, hyperparameters
from lightning_rudra.core.protocol import ProtocolConfig, Server
from lightning_rudra.core.update import Push
from lightning_rudra.transport.shm import SHM_DIR
from lightning_rudra.transport.timeline import TIMELINE
from benchmarks import timeline
from tests import rpc_harness as harness

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def sgd_reference(steps, batch, lr=0.1, momentum=0.9):
    net = harness.model()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    x, y = harness.data()
    for step in range(steps):
        rows = torch.arange(step * batch, (step + 1) * batch)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x[rows]), y[rows]).backward()
        opt.step()
    return [p.detach() for p in net.parameters()]


def overlap_reference(steps, mu, lr=0.1, momentum=0.9):
    """One learner under overlap (Rudra-adv*): gradient k (k >= 1) comes from the weights before update k - 1."""
    master, probe = harness.model(), harness.model()
    opt = torch.optim.SGD(master.parameters(), lr=lr, momentum=momentum)
    x, y = harness.data()
    history = [[p.detach().clone() for p in master.parameters()]]
    for step in range(steps):
        for p, w in zip(probe.parameters(), history[max(step - 1, 0)]):
            p.data.copy_(w)
        probe.zero_grad()
        rows = torch.arange(step * mu, (step + 1) * mu)
        torch.nn.functional.mse_loss(probe(x[rows]), y[rows]).backward()
        for p, q in zip(master.parameters(), probe.parameters()):
            p.grad = q.grad.clone()
        opt.step()
        history.append([p.detach().clone() for p in master.parameters()])
    return history[-1]


def check_ok(results):
    for result in results:
        assert isinstance(result, dict), result


@pytest.fixture
def no_shared_memory_left():
    """Every test's server removes its shared-memory files, however it ends."""
    before = set(os.listdir(SHM_DIR))
    yield
    left = [name for name in set(os.listdir(SHM_DIR)) - before if name.startswith("lightning_rudra-")]
    assert not left, left


def _hardsync(learners: int, steps: int, mu: int, **options):
    """``learners`` learners train ``steps`` hardsync steps with batch ``mu`` each (``options``: more of
    ``harness.train``'s arguments); their results, every one of them checked to be ok."""
    results = harness.run_learners(
        learners, harness.train, config=ProtocolConfig(learners, "hardsync"), steps=steps, mu=mu, **options
    )
    check_ok(results)
    return results


# 2 servers cut the 65 weights of the test model inside its first weight matrix (RPC with one server:
# test_shared_memory_that_cannot_be_allocated_falls_back_to_rpc)
@pytest.mark.parametrize("shared_memory, num_servers", [(True, 1), (True, 2), (False, 2)])
def test_hardsync_equals_single_process_sgd_with_batch_mu_lambda(shared_memory, num_servers, no_shared_memory_left):
    learners, mu, steps = 3, 4, 6
    results = _hardsync(learners, steps, mu, shared_memory=shared_memory, num_servers=num_servers)
    assert [r["shared_memory"] for r in results] == [shared_memory] * learners
    reference = sgd_reference(steps, mu * learners)
    for result in results:  # every learner ends with the same, exact weights
        for mine, expected in zip(result["params"], reference):
            torch.testing.assert_close(mine, expected, rtol=0, atol=1e-5)
    stats = results[0]["stats"]
    assert stats.clock == steps and stats.gradients == steps * learners
    assert stats.staleness == {0: steps * learners}
    assert all(sigma == 0 for r in results for _, sigma in r["pushes"])


def test_the_timeline_of_a_real_run_has_every_push_on_both_sides(monkeypatch, tmp_path, no_shared_memory_left):
    """``RUDRA_TIMELINE``: the learners and the server processes they start each write their events; every push of
    every learner to every server is sent, received, answered, replied to and loaded once, in that order, each
    server's events naming it and the learner; a hardsync round is answered once its last push came."""
    directory = tmp_path / "timeline"
    monkeypatch.setenv(TIMELINE, str(directory))
    learners, servers, steps = 3, 2, 5
    _hardsync(learners, steps, 4, num_servers=servers)
    events = timeline.read(str(directory))
    assert len(os.listdir(directory)) == learners + servers  # each process its own file
    counts = collections.Counter(event for _, event, _ in events)
    assert counts["push"] == learners * steps
    assert {counts[e] for e in timeline.EVENTS} == {learners * steps * servers}
    at = collections.defaultdict(list)  # (event, server, learner) -> times
    for t, event, numbers in events:
        if event in ("received", "answered"):
            at[(event, *numbers)].append(t)
    pairs = {(s, r) for s in range(servers) for r in range(learners)}
    assert {key[1:] for key in at} == pairs and all(len(times) == steps for times in at.values())
    for s in range(servers):
        for k in range(steps):
            last_push = max(at["received", s, r][k] for r in range(learners))
            assert min(at["answered", s, r][k] for r in range(learners)) >= last_push
    result = timeline.breakdown(events, warmup=0)
    assert sorted(result) == list(range(learners))
    for row in result.values():
        assert row["steps"] == steps - 1 and row["compute"] >= 0 and sorted(row["servers"]) == [0, 1]
        for parts in row["servers"].values():
            assert all(parts[part] >= 0 for part in timeline.PARTS)  # one clock: each event after the one before


def test_hardsync_over_servers_cut_between_parameters_one_of_them_empty(no_shared_memory_left):
    """An optimizer not known to be elementwise: the 3 servers' cuts move to the parameter boundaries nearest to
    them (0 and 48 of 65), so the first server owns nothing and still takes every push; still exactly SGD."""
    learners, mu, steps = 2, 4, 5
    results = _hardsync(learners, steps, mu, num_servers=3, optimizer=harness.SubclassedSGD)
    assert [r["owned"] for r in results] == [[0, 1, 3]] * learners
    for result in results:
        for mine, expected in zip(result["params"], sgd_reference(steps, mu * learners)):
            torch.testing.assert_close(mine, expected, rtol=0, atol=1e-5)
    stats = results[0]["stats"]  # the empty server's: it counted every update and gradient
    assert stats.clock == steps and stats.gradients == steps * learners


@pytest.mark.parametrize("num_servers", [1, 2])
def test_async_with_one_learner_is_plain_sgd(num_servers, no_shared_memory_left):
    # through shared memory; over RPC in test_shared_memory_that_cannot_be_allocated_falls_back_to_rpc
    steps, mu = 8, 5
    [result] = harness.run_learners(
        1, harness.train, config=ProtocolConfig(1, "async"), steps=steps, mu=mu, num_servers=num_servers
    )
    check_ok([result])
    assert result["shared_memory"]
    for mine, expected in zip(result["params"], sgd_reference(steps, mu)):
        torch.testing.assert_close(mine, expected, rtol=0, atol=0)
    assert result["stats"].clock == steps and result["stats"].staleness == {0: steps}


def _one_server_unmapped(rank, clients, **kwargs):
    """harness.train, with server 1's shared memory refused (as one on another host): its pushes and their replies
    carry the tensors over the push stream, server 0's go through shared memory."""
    harness.refuse_shared_memory_of_server_1()
    return harness.train(rank, clients, **kwargs)


def _counting_pushes_in_flight(rank, clients, **kwargs):
    """``harness.train``, recording how many of this learner's pushes were unanswered as each push went out."""
    from lightning_rudra.learner.client import LearnerClient

    unanswered, at_each_push = [0], []
    push, receive = LearnerClient.push, LearnerClient.receive

    def counted_push(self, *args, **options):
        at_each_push.append(unanswered[0])
        unanswered[0] += 1
        return push(self, *args, **options)

    def counted_receive(self, pushed):
        unanswered[0] -= 1
        return receive(self, pushed)

    LearnerClient.push, LearnerClient.receive = counted_push, counted_receive
    return {**harness.train(rank, clients, **kwargs), "in flight": at_each_push}


@pytest.mark.parametrize("servers", ["one, mapped", "two, one over the stream", "one, through RPC"])
def test_overlap_computes_on_the_newest_weights_received(servers, no_shared_memory_left):
    """Rudra-adv*: with one learner, gradient k (k >= 1) comes from the weights before update k - 1 (σ = 1). With a
    server whose shared memory the learner cannot map, its next push goes out over the stream while the reply to
    the last still comes back (issue 34): the arithmetic is the same. Through RPC (``shared_memory=False``: no
    stream), whose pool of threads could apply a push before the last one (whose older buffers, BatchNorm's count,
    would then replace its own), a push goes out once the last is answered: the same arithmetic again."""
    steps, mu, lr, momentum = 6, 4, 0.1, 0.9
    target, num_servers = {
        "one, mapped": (harness.train, 1),
        "two, one over the stream": (_one_server_unmapped, 2),
        "one, through RPC": (_counting_pushes_in_flight, 1),
    }[servers]
    [result] = harness.run_learners(
        1,
        target,
        num_servers=num_servers,
        config=ProtocolConfig(1, "async"),
        steps=steps,
        mu=mu,
        lr=lr,
        momentum=momentum,
        overlap=True,
        shared_memory=servers != "one, through RPC",
    )
    check_ok([result])
    assert result["mapped"] == {1: [servers == "one, mapped"], 2: [True, False]}[num_servers]
    if servers == "one, through RPC":
        assert result["in flight"] == [0] * steps  # each push once the last was answered
    assert result["stats"].staleness == {0: 1, 1: steps - 1}
    for mine, expected in zip(result["params"], overlap_reference(steps, mu, lr, momentum)):
        torch.testing.assert_close(mine, expected, rtol=0, atol=1e-6)


DANA = ProtocolConfig(1, "async", compensation="momentum+clip+syncnorm+dana")  # the strategy's default


def step_ahead_reference(steps, mu, lr, momentum, step_ahead=True):
    """One learner under overlap with dana's own steps, against the protocol's own server in this process: gradient
    k (k >= 1) comes from the weights before update k - 1, less the learner's own step of gradient k - 1 at the rate
    of the reply to push k - 2 (without ``step_ahead``: not less it)."""
    model, probe = harness.model(), harness.model()
    params = list(model.parameters())
    optimizer, probe_optimizer = (torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum) for m in (model, probe))
    server = Server(DANA, [p.detach() for p in params], [], [OptimizerSpec.from_optimizer(optimizer, params)])
    hparams = [hyperparameters(g) for g in optimizer.param_groups]
    own, (x, y), result = StepAhead(1, undo=False), harness.data(), None
    weights, _, timestamp = server.pull()
    torch.nn.utils.vector_to_parameters(weights[0], probe.parameters())
    for k in range(steps):
        probe.zero_grad()
        rows = torch.arange(k * mu, (k + 1) * mu)
        torch.nn.functional.mse_loss(probe(x[rows]), y[rows]).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in probe.parameters()])
        weights, _, now = server.pull()  # the reply to push k - 1: loaded as push k goes
        pushed = server.push(Push(0, 0, [grad], torch.ones(len(params), dtype=torch.bool), timestamp, hparams, []))
        if result is not None:
            own.settled(0, result.status, result.staleness, result.update.lr_scale)
        result, timestamp = pushed, now
        torch.nn.utils.vector_to_parameters(weights[0], probe.parameters())
        if step_ahead:
            own.step(0, probe_optimizer, {id(p): p.grad for p in probe.parameters()})
    return [p.detach() for p in server.params]


def test_overlap_with_step_ahead_computes_on_the_newest_weights_less_its_own_step(no_shared_memory_left):
    """dana's own steps (the strategy's with overlap): between its push and the reply, the learner steps its own
    gradient on the weights it holds, at the rate its last reply said; the reply then replaces them. One learner, so
    that the order is known."""
    steps, mu, lr, momentum = 8, 4, 0.1, 0.9
    options = dict(steps=steps, mu=mu, lr=lr, momentum=momentum, overlap=True)
    [result] = harness.run_learners(1, harness.train, config=DANA, step_ahead=True, **options)
    check_ok([result])
    assert result["stats"].staleness == {0: 1, 1: steps - 1}
    reference, without = (step_ahead_reference(steps, mu, lr, momentum, own) for own in (True, False))
    for mine, expected, other in zip(result["params"], reference, without):
        torch.testing.assert_close(mine, expected, rtol=0, atol=1e-6)
        assert not torch.allclose(mine, other, atol=1e-4)  # the own steps changed what was computed


def test_shared_memory_that_cannot_be_allocated_falls_back_to_rpc(monkeypatch, no_shared_memory_left):
    monkeypatch.setenv("LIGHTNING_RUDRA_SHM_DIR", "/nonexistent-lightning-rudra")
    steps, mu = 4, 5
    [result] = harness.run_learners(1, harness.train, config=ProtocolConfig(1, "async"), steps=steps, mu=mu)
    check_ok([result])
    assert not result["shared_memory"]
    for mine, expected in zip(result["params"], sgd_reference(steps, mu)):
        torch.testing.assert_close(mine, expected, rtol=0, atol=0)


@pytest.mark.parametrize("protocol, n", [("softsync", 1), ("async", 1)])
def test_softsync_and_async_count_updates_and_staleness(protocol, n, no_shared_memory_left):
    learners, steps = 3, 6
    config = ProtocolConfig(learners, protocol, n)
    results = harness.run_learners(learners, harness.train, config=config, steps=steps, mu=2)
    check_ok(results)
    stats = results[0]["stats"]
    c = config.gradients_per_update
    assert stats.gradients == learners * steps == sum(stats.staleness.values())
    assert stats.clock == -(-stats.gradients // c)  # every c gradients, the rest flushed at the end
    assert stats.max_staleness <= stats.clock
    # each learner saw the σ the server recorded for its gradients
    seen = sorted(sigma for r in results for _, sigma in r["pushes"])
    assert seen == sorted(s for s, count in stats.staleness.items() for _ in range(count))
    # everybody ends on the same, final weights
    for result in results[1:]:
        for a, b in zip(result["params"], results[0]["params"]):
            assert torch.equal(a, b)


def test_bad_push_over_rpc_is_refused_and_leaves_the_weights():
    [result] = harness.run_learners(1, harness.push_garbage, config=ProtocolConfig(1, "async"))
    check_ok([result])
    assert "float32 x 3" in result["error"] and "expected [torch.float32 x" in result["error"]
    assert result["unchanged"] and result["stats"].clock == 0 and result["stats"].gradients == 0


def test_a_dead_learner_ends_the_others_with_an_error():
    # learner 0 waits in a hardsync round that learner 1 will never join: the server sees its process end
    results = harness.run_learners(2, harness.die_after_one_step, config=ProtocolConfig(2, "hardsync"), timeout=60.0)
    assert "learner 1 (on 127.0.0.1) ended before training did: its process (pid " in results[0], results[0]
    assert "training cannot go on without it" in results[0]
    assert results[1] == "died with exit code 1"


def test_a_live_learner_slower_than_the_timeout_is_waited_for():
    results = harness.run_learners(
        2, harness.slow_first_push, config=ProtocolConfig(2, "hardsync"), timeout=3.0, sleep_s=7.0
    )
    check_ok(results)
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


def test_the_shared_epoch_deals_every_sample_once_and_more_to_the_fast_learner():
    plan = EpochPlan(96, 4, shuffle=True, seed=5)
    results = harness.run_learners(
        2, harness.draw_shared_epochs, config=ProtocolConfig(2, "async"), plan=plan, epochs=2, sleep_s=0.05
    )
    check_ok(results)
    for epoch in range(2):
        mine, theirs = ([b for e, b in r["batches"] if e == epoch] for r in results)
        assert sorted(i for batch in mine + theirs for i in batch) == list(range(96))
        assert len(mine) > 2 * len(theirs), (len(mine), len(theirs))
    # positions are taken by the trainer loop; here nobody took them
    assert sorted(results[0]["positions"] + results[1]["positions"]) == list(range(24))


def test_ssp_keeps_a_straggler_within_the_bound_and_drops_nothing(no_shared_memory_left):
    # async, λ = 2, s = 1, on_stale='block': learner 1 sleeps before each step, so learner 0 would run ahead (under
    # 'drop' learner 1's gradients arrive several updates stale and are dropped); held back, it waits for learner 1
    learners, steps = 2, 12
    config = ProtocolConfig(learners, "async", max_staleness=1, on_stale="block")
    results = harness.run_learners(learners, harness.train, config=config, steps=steps, mu=2, delays={1: 0.05})
    check_ok(results)
    stats = results[0]["stats"]
    assert stats.max_staleness <= 1 and stats.dropped == 0
    assert stats.gradients == learners * steps == sum(stats.staleness.values()) == stats.clock
    assert all(status == "accepted" and sigma <= 1 for r in results for status, sigma in r["pushes"])


def _steps_on(rows_per_step, lr=0.1):
    """Plain SGD from the test model's initial weights, one step per list of rows (their gradient, mean loss)."""
    net = harness.model()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    x, y = harness.data()
    for rows in rows_per_step:
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x[rows]), y[rows]).backward()
        opt.step()
    return [p.detach() for p in net.parameters()]


@pytest.mark.parametrize("shared_memory", [True, False])
def test_batchsync_averages_the_first_k_gradients_of_the_current_weights_exactly(shared_memory, no_shared_memory_left):
    """K = λ = 2, learner 1 a second late to each step: learner 0 gives both gradients of round 0 (its reply comes
    at once, the round open), learner 1's gradient of the weights of clock 0 comes late, and its second one, alone,
    is applied when it finishes. Through shared memory the round's sum must not live in learner 0's buffer, which
    its second gradient overwrites."""
    mu, lam = 4, 2
    results = harness.run_learners(
        lam,
        harness.train,
        config=ProtocolConfig(lam, "batchsync"),
        steps=2,
        mu=mu,
        momentum=0.0,
        shared_memory=shared_memory,
        delays={1: 1.0},
    )
    check_ok(results)
    assert [r["shared_memory"] for r in results] == [shared_memory] * lam
    rows = [torch.arange(i * mu * lam, (i + 1) * mu * lam)[r::lam] for i in range(2) for r in range(lam)]
    # round 0: learner 0's two gradients (rows of steps 0 and 1), averaged; then learner 1's of step 1, alone
    expected = _steps_on([torch.cat([rows[0], rows[2]]), rows[3]])
    for result in results:
        for mine, theirs in zip(result["params"], expected):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    assert [status for status, _ in results[1]["pushes"]] == ["late", "accepted"]
    stats = results[0]["stats"]
    assert (stats.clock, stats.gradients, stats.late, stats.staleness) == (2, 3, 1, {0: 3})
