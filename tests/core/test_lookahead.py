"""``dana`` on scripted pushes: each learner's momentum kept on the server and Nesterov's step taken on it, by hand;
softsync's shared part; the identity where nothing is stale; its buffers in the checkpoint; the refusals."""

import copy

import pytest
import torch

from lightning_rudra.core.compensation import RULES_STATE, parse_compensation
from lightning_rudra.core.lookahead import StepAhead
from lightning_rudra.core.optimizers import OptimizerSpec
from lightning_rudra.core.protocol import ProtocolConfig, Server
from lightning_rudra.core.stats import Stats
from lightning_rudra.core.update import Push
from tests.core.test_compensation import push, scalar_server, weight


def momenta(server):
    return {k: v.item() for k, v in server.optimizer_state(0)["state"].get(RULES_STATE, {}).get(0, {}).items()}


def test_each_learner_keeps_its_own_momentum_and_the_server_steps_nesterov_on_it():
    server, opt = scalar_server("momentum+dana", momentum=0.9)
    push(server, opt, 0, 1.0, 0)  # σ = 0, ⟨σ⟩ = 0: nothing stale yet, the rate · c/λ = 0.05 and torch's momentum
    assert weight(server) == pytest.approx(0.95) and momenta(server) == {}
    push(server, opt, 1, 2.0, 0)  # σ = 1: learner 1's buffer 2, step 0.05 · (2 + 0.9 · 2)
    assert weight(server) == pytest.approx(0.95 - 0.05 * 3.8)
    push(server, opt, 0, 1.0, 1)  # learner 0's own buffer (the shared one before staleness is not its): 1
    assert weight(server) == pytest.approx(0.76 - 0.05 * 1.9)
    push(server, opt, 1, 1.0, 2)  # learner 1: 0.9 · 2 + 1 = 2.8, step 0.05 · (1 + 0.9 · 2.8)
    assert weight(server) == pytest.approx(0.665 - 0.05 * 3.52)
    assert momenta(server) == {"momentum_0": pytest.approx(1.0), "momentum_1": pytest.approx(2.8)}
    group = server.optimizers[0].param_groups[0]
    assert group["momentum"] == 0.9 and group["nesterov"] and not opt.param_groups[0]["nesterov"]


def test_a_softsync_update_steps_on_its_learners_mean_buffer_and_each_keeps_its_own_decay():
    server, opt = scalar_server("momentum+dana", "softsync", learners=4, n=2, momentum=0.5)  # c = 2, c/λ = 1/2
    for learner, grad in ((0, 1.0), (1, 3.0)):  # σ = 0: torch's own momentum
        push(server, opt, learner, grad, 0)
    assert weight(server) == pytest.approx(1 - 0.05 * 2.0)
    for learner, grad in ((2, 2.0), (3, 4.0)):  # σ = 1: mean gradient 3 on no buffers yet, step 0.05 · (3 + 0.5 · 3)
        push(server, opt, learner, grad, 0)
    assert weight(server) == pytest.approx(0.9 - 0.05 * 4.5)
    assert momenta(server) == {"momentum_2": pytest.approx(3.0), "momentum_3": pytest.approx(3.0)}
    for learner, grad, timestamp in ((2, 1.0, 1), (0, 3.0, 0)):  # σ = 1, 2: mean buffer (3 + 0) / 2, ḡ = 2
        push(server, opt, learner, grad, timestamp)
    step = 2.0 + 0.5 * (0.5 * 1.5 + 2.0)  # ḡ + β · (β · mean + ḡ)
    assert server.last_updates[0].rule_scale == pytest.approx(1 / 2.5)  # min(c/λ, 1/(mean σ + 1))
    assert weight(server) == pytest.approx(0.675 - 0.1 / 2.5 * step)
    # each holds β · its own + ḡ: learner 2's 0.5 · 3 + 2, learner 0's 0 + 2
    assert momenta(server) == {
        "momentum_0": pytest.approx(2.0),
        "momentum_2": pytest.approx(3.5),
        "momentum_3": pytest.approx(3.0),
    }


@pytest.mark.parametrize("protocol", ["async", "hardsync"])
def test_nothing_stale_is_plain_sgd(protocol):
    """One async learner (σ = 0 always) and hardsync: every update is the optimizer's own."""
    learners = 1 if protocol == "async" else 2
    server, opt = scalar_server("momentum+dana", protocol, learners=learners, momentum=0.9, nesterov=True)
    w = torch.ones(1, requires_grad=True)
    plain = torch.optim.SGD([w], lr=0.1, momentum=0.9, nesterov=True)
    for step, grad in enumerate([1.0, -2.0, 0.5, 3.0]):
        for learner in range(learners):
            push(server, opt, learner, grad, step)
        w.grad = torch.tensor([grad])
        plain.step()
        assert weight(server) == w.item()


def test_what_it_does_not_keep_is_the_momentum_rules():
    """Dampening (no look-ahead in Nesterov's form), no momentum, and Adam: as under ``momentum`` alone."""
    for options in ({"momentum": 0.9, "dampening": 0.5}, {"momentum": 0.0}):
        weights = []
        for rule in ("momentum", "momentum+dana"):
            server, opt = scalar_server(rule, **options)
            for learner, grad, timestamp in ((0, 1.0, 0), (1, 2.0, 0), (0, -1.0, 1), (1, 0.5, 2)):
                push(server, opt, learner, grad, timestamp)
            weights.append(weight(server))
            assert momenta(server) == {}
        assert weights[0] == weights[1], options
    weights = []
    for rule in ("momentum", "momentum+dana"):
        server, opt = scalar_server(rule, optimizer=torch.optim.Adam)
        for learner, grad, timestamp in ((0, 1.0, 0), (1, 2.0, 0), (0, -1.0, 1)):
            push(server, opt, learner, grad, timestamp)
        weights.append(weight(server))
    assert weights[0] == weights[1]


def test_a_refused_gradient_moves_neither_the_weights_nor_its_learners_buffer():
    """Its learner pushed a NaN (skipped), but nothing of it is in the update: the next is the other learner's alone."""
    w = torch.ones(1)
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    config = ProtocolConfig(2, "async", compensation="momentum+dana", nonfinite="skip")
    server = Server(config, [w], [], [OptimizerSpec.from_optimizer(opt, [w])])
    push(server, opt, 0, 1.0, 0)
    push(server, opt, 1, 2.0, 0)  # σ = 1: learner 1's buffer 2
    push(server, opt, 0, 1.0, 1)  # learner 0's: 1
    before, buffers = weight(server), momenta(server)
    assert push(server, opt, 1, float("nan"), 3).status == "rejected"
    assert momenta(server) == buffers
    push(server, opt, 0, 1.0, 3)  # learner 0's own: 0.9 · 1 + 1, step lr · min(1/2, 1/1) · (1 + 0.9 · 1.9)
    assert weight(server) == pytest.approx(before - 0.05 * 2.71)
    assert momenta(server) == {"momentum_0": pytest.approx(1.9), "momentum_1": pytest.approx(2.0)}


def test_a_dropped_gradient_is_not_in_its_updates_mean_buffer():
    """Softsync (c = 2): a gradient staler than max_staleness is dropped; the update it would have been part of
    applies the other gradient alone, on its learner's buffer alone."""
    w = torch.ones(1)
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.5)
    config = ProtocolConfig(4, "softsync", n=2, max_staleness=1, compensation="momentum+dana")
    server = Server(config, [w], [], [OptimizerSpec.from_optimizer(opt, [w])])
    for learner, grad, timestamp in ((0, 1.0, 0), (1, 3.0, 0), (2, 2.0, 0), (3, 4.0, 0), (2, 1.0, 2), (0, 1.0, 2)):
        push(server, opt, learner, grad, timestamp)
    before, buffers = weight(server), momenta(server)
    assert buffers["momentum_3"] == pytest.approx(3.0)
    assert push(server, opt, 2, 5.0, 0).status == "dropped"  # σ = 3
    push(server, opt, 3, 1.0, 3)  # σ = 0, one gradient: its learner's 0.5 · 3 + 1, step 0.1 · 1/4 · (1 + 0.5 · 2.5)
    assert server.last_updates[0].staleness == (0,)
    assert weight(server) == pytest.approx(before - 0.025 * 2.25)
    assert momenta(server) == {**buffers, "momentum_3": pytest.approx(2.5)}


def test_a_learner_with_two_gradients_in_an_update_counts_twice():
    """Softsync (c = 2), learner 2's two gradients in one update: its buffer twice in the mean, and twice
    β·v + ḡ after."""
    server, opt = scalar_server("momentum+dana", "softsync", learners=4, n=2, momentum=0.5)
    for learner, grad, timestamp in ((0, 1.0, 0), (1, 3.0, 0), (2, 2.0, 0), (3, 4.0, 0)):
        push(server, opt, learner, grad, timestamp)
    before = weight(server)
    assert momenta(server) == {"momentum_2": pytest.approx(3.0), "momentum_3": pytest.approx(3.0)}
    push(server, opt, 2, 1.0, 2)
    push(server, opt, 2, 3.0, 2)  # σ = 0, 0: lr 0.1 · 1/2, mean buffer 3, ḡ = 2: step 2 + 0.5 · (0.5 · 3 + 2)
    assert weight(server) == pytest.approx(before - 0.05 * 3.75)
    assert momenta(server) == {"momentum_2": pytest.approx(3.75), "momentum_3": pytest.approx(3.0)}


def test_the_learners_momenta_are_saved_and_resume_exactly():
    server, opt = scalar_server("momentum+dana", momentum=0.9)
    for learner, grad, timestamp in ((0, 1.0, 0), (1, 2.0, 0), (0, -1.0, 1)):
        push(server, opt, learner, grad, timestamp)
    saved = copy.deepcopy(server.optimizer_state(0))
    assert set(saved["state"][RULES_STATE][0]) == {"momentum_0", "momentum_1"}
    params = [p.clone() for p in server.params]
    again = Server(
        server.config,
        params,
        [],
        [OptimizerSpec.from_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), params)],
        Stats.from_dict(server.stats.to_dict()),
    )
    again.load_optimizer_state(0, saved)
    for s in (server, again):
        clock = s.clock
        for learner, grad, timestamp in ((1, 0.5, clock - 1), (0, 2.0, clock), (1, -1.0, clock + 1)):
            push(s, opt, learner, grad, timestamp)
    assert weight(server) == weight(again) and momenta(server) == momenta(again)


def _tensors(state, path=()):
    """(path, tensor) for every tensor of a state dict."""
    if isinstance(state, torch.Tensor):
        yield path, state
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from _tensors(v, (*path, k))
    elif isinstance(state, (list, tuple)):
        for k, v in enumerate(state):
            yield from _tensors(v, (*path, k))


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam])
def test_a_saved_state_is_a_copy_that_later_updates_leave_as_it_was(optimizer):
    """A checkpoint is written after the server's lock is let go, while the other learners' pushes go on: the state
    it holds must be its clock's, not the live buffers that torch's step and dana's change in place."""
    options = {"momentum": 0.9} if optimizer is torch.optim.SGD else {}
    server, opt = scalar_server("momentum+dana", optimizer=optimizer, **options)
    for learner, grad, timestamp in ((0, 1.0, 0), (1, 2.0, 0), (0, -1.0, 1)):
        push(server, opt, learner, grad, timestamp)
    saved = server.optimizer_state(0)
    kept = dict(_tensors(copy.deepcopy(saved)))
    push(server, opt, 1, 3.0, 1)
    now = dict(_tensors(server.optimizer_state(0)))
    held = dict(_tensors(saved))
    assert held.keys() == kept.keys() and len(held) >= 2
    assert all(torch.equal(held[k], kept[k]) for k in kept)
    assert any(not torch.equal(now[k], kept[k]) for k in kept if k in now)  # the update did change them


def test_dana_needs_the_momentum_rule():
    assert parse_compensation("momentum+clip+dana") == ("momentum", "clip", "dana")
    with pytest.raises(ValueError, match=r"compensation='clip\+dana': 'dana' keeps momentum SGD's momentum"):
        parse_compensation("clip+dana")
    with pytest.raises(ValueError, match="is not supported"):
        ProtocolConfig(2, "async", compensation="momentum+dana+dana")


def test_clip_takes_only_the_outliers_of_updates_that_keep_their_momentum(monkeypatch):
    """The ``clip`` rule's limit: the 90th percentile of the recent stale norms for dana's updates, the median for
    the others (momentum switched off, or none to keep)."""
    from lightning_rudra.core.compensation import NormWindow

    window = NormWindow()
    norms = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    for norm in norms:
        window.clip([torch.tensor([norm])])
    assert window.clip([torch.tensor([8.5])], percentile=90) == 1.0  # the 90th of (1..10, 8.5): index 9, 9
    assert window.clip([torch.tensor([8.5])]) == pytest.approx(7.0 / 8.5)  # the median of 12 norms (index 6): 7
    asked = []
    monkeypatch.setattr(NormWindow, "clip", lambda self, grads, percentile=50: asked.append(percentile) or 1.0)
    for rule, momentum, expected in (
        ("momentum+clip+dana", 0.9, 90),
        ("momentum+clip+dana", 0.0, 50),
        ("momentum+clip", 0.9, 50),
    ):
        asked.clear()
        server, opt = scalar_server(rule, momentum=momentum)
        for learner, timestamp in ((0, 0), (1, 0), (0, 1)):  # the first is fresh: not clipped
            push(server, opt, learner, 1.0, timestamp)
        assert asked == [expected, expected], (rule, momentum)


@pytest.mark.parametrize("other, expected", [({"momentum": 0.9}, 90), ({"momentum": 0.9, "dampening": 0.5}, 50)])
def test_an_update_with_a_group_that_takes_the_momentum_rules_step_is_clipped_at_the_median(
    monkeypatch, other, expected
):
    """One norm per update: the outliers only if every group with a gradient takes dana's step."""
    from lightning_rudra.core.compensation import NormWindow

    asked = []
    monkeypatch.setattr(NormWindow, "clip", lambda self, grads, percentile=50: asked.append(percentile) or 1.0)
    params = [torch.ones(1), torch.ones(1)]
    opt = torch.optim.SGD([{"params": [params[0]], "momentum": 0.9}, {"params": [params[1]], **other}], lr=0.1)
    config = ProtocolConfig(2, "async", compensation="momentum+clip+dana")
    server = Server(config, params, [], [OptimizerSpec.from_optimizer(opt, params)])
    hparams = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    for learner, timestamp in ((0, 0), (1, 0), (0, 1)):
        packed = server.grad_layouts[0].pack([torch.ones(1), torch.ones(1)])
        server.push(Push(learner, 0, packed, torch.tensor([True, True]), timestamp, hparams, []))
    assert asked == [expected, expected]


def test_the_step_ahead_takes_nesterovs_step_at_the_rate_the_server_applied_on_an_estimate_of_its_buffer():
    """``overlap``: the learner's own step on its weights while its push is in flight, as the server's dana update
    (Nesterov on the learner's buffer, v ← β·v + g + wd·w) at the rate of its last reply over c; the gradient is left
    as it was, and nothing moves before a reply says the gradients are stale."""
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    frozen = torch.nn.Parameter(torch.tensor([5.0]))  # no gradient: does not move
    opt = torch.optim.SGD([w, frozen], lr=0.1, momentum=0.9, weight_decay=0.01)
    steps = StepAhead(per_update=2, undo=False)
    g = torch.tensor([1.0, 2.0])
    steps.step(0, opt, {id(w): g})  # no reply yet: dana has not started
    steps.settled(0, "accepted", 0, 0.5)  # nor when a reply says σ = 0
    steps.step(0, opt, {id(w): g})
    assert torch.equal(w.detach(), torch.tensor([1.0, -2.0])) and not steps.momenta
    steps.settled(0, "accepted", 1, 0.5)  # an update of c = 2 gradients at 0.5 · lr: each gradient's share 0.25
    steps.step(0, opt, {id(w): g})
    d = g + 0.01 * torch.tensor([1.0, -2.0])  # v = d: the first buffer is the gradient
    expected = torch.tensor([1.0, -2.0]) - 0.025 * (d + 0.9 * d)
    torch.testing.assert_close(w.detach(), expected)
    steps.settled(0, "accepted", 2, 0.2)  # a staler push: the server's rate fell
    steps.step(0, opt, {id(w): g})
    v = 0.9 * d + (g + 0.01 * expected)
    torch.testing.assert_close(w.detach(), expected - 0.01 * (g + 0.01 * expected + 0.9 * v))
    torch.testing.assert_close(steps.momenta[0, id(w)], v)
    assert torch.equal(g, torch.tensor([1.0, 2.0])) and frozen.item() == 5.0 and set(steps.momenta) == {(0, id(w))}


def test_a_push_the_server_dropped_leaves_the_buffer_as_before_it_and_each_optimizer_has_its_own():
    w = torch.nn.Parameter(torch.zeros(1))
    first, second = (torch.optim.SGD([w], lr=0.1, momentum=0.9) for _ in range(2))  # two optimizers, one parameter
    steps = StepAhead(per_update=1, undo=True)  # (max_staleness set: the server may drop a push)
    steps.settled(0, "accepted", 1, 0.5)
    steps.settled(1, "accepted", 1, 0.1)  # each optimizer at the rate its own reply said
    steps.step(0, first, {id(w): torch.ones(1)})
    assert w.item() == pytest.approx(-0.1 * 0.5 * 1.9)
    steps.step(1, second, {id(w): -5 * torch.ones(1)})
    assert w.item() == pytest.approx(-0.1 * 0.5 * 1.9 + 0.1 * 0.1 * 5 * 1.9, abs=1e-7)
    assert steps.momenta[0, id(w)].item() == 1.0 and steps.momenta[1, id(w)].item() == -5.0
    steps.settled(0, "accepted", 1, 0.5)
    steps.step(0, first, {id(w): torch.ones(1)})
    assert steps.momenta[0, id(w)].item() == pytest.approx(1.9)
    steps.settled(0, "dropped", 4, 0.5)  # staler than max_staleness: not in the server's buffer
    assert steps.momenta[0, id(w)].item() == pytest.approx(1.0)
    steps.settled(1, "rejected", 0, 0.5)  # not finite: the first buffer goes, as the server never had it
    assert (1, id(w)) not in steps.momenta


def test_the_step_ahead_brings_a_learner_under_overlap_near_the_weights_its_reply_will_bring():
    """One learner under overlap and the default rule, against the protocol's server: after each own step, the
    weights it computes on are far nearer the next reply's than the weights it holds without the step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    config = ProtocolConfig(1, "async", compensation="momentum+clip+syncnorm+dana")
    server = Server(config, [p.detach().clone() for p in params], [], [OptimizerSpec.from_optimizer(opt, params)])
    hparams = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    steps, ratios = StepAhead(per_update=1, undo=False), []
    held, timestamp, result = server.pull()[0][0], 0, None
    torch.nn.utils.vector_to_parameters(held, params)
    for k in range(12):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x[k * 4 : k * 4 + 4]), y[k * 4 : k * 4 + 4]).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in params])
        held, _, now = server.pull()  # the reply to push k - 1, loaded as push k goes
        pushed = server.push(Push(0, 0, [grad], torch.ones(len(params), dtype=torch.bool), timestamp, hparams, []))
        if result is not None:
            steps.settled(0, result.status, result.staleness, result.update.lr_scale)
        result, timestamp = pushed, now
        torch.nn.utils.vector_to_parameters(held[0].clone(), params)  # (its views otherwise)
        steps.step(0, opt, {id(p): p.grad for p in params})
        if k >= 3:  # the next reply: the weights after this push's update
            ahead, reply = torch.nn.utils.parameters_to_vector(params), server.pull()[0][0]
            ratios.append(((ahead - reply).norm() / (held[0] - reply).norm()).item())
    assert max(ratios) < 0.5 and max(ratios[-4:]) < 0.2, ratios


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.Adam(ps, lr=0.1),  # dana is SGD's
        lambda ps: torch.optim.SGD(ps, lr=0.1),  # no momentum: the server steps with the momentum rule
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5),  # dampened: the same
    ],
)
def test_the_step_ahead_leaves_what_dana_does_not_step_as_it_was(make):
    w = torch.nn.Parameter(torch.ones(2))
    steps = StepAhead(per_update=1, undo=False)
    steps.settled(0, "accepted", 1, 0.5)
    steps.step(0, make([w]), {id(w): torch.ones(2)})
    assert torch.equal(w.detach(), torch.ones(2)) and not steps.momenta


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_the_servers_nesterov_step_is_torchs_element_by_element_without_a_new_tensor_for_it(weight_decay):
    """dana's step goes by torch's foreach path, which adds β·v to the server's own gradient in place instead of
    making g + β·v a new tensor (single-tensor path): the same weights and buffers bit for bit, the optimizer's
    own ``foreach`` setting left as it was, and another optimizer class stepped as it steps."""
    from lightning_rudra.core.lookahead import step_with_learner_momenta

    def stepped(make, **extra):
        generator = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(300, generator=generator)) for _ in range(2)]
        opt = make(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=weight_decay, **extra)
        states = [{}, {}]
        for step in range(3):
            for p in params:
                p.grad = torch.randn(300, generator=generator)
            step_with_learner_momenta(opt, params, states, [step % 2])
        return opt, params, states

    opt, params, states = stepped(torch.optim.SGD, foreach=False)
    assert all(group["foreach"] is False for group in opt.param_groups)  # the user's setting kept
    # torch's single-tensor steps, by hand: the same three steps
    generator = torch.Generator().manual_seed(0)
    mine = [torch.randn(300, generator=generator) for _ in range(2)]
    buffers: dict[tuple[int, int], torch.Tensor] = {}
    for step in range(3):
        grads = [torch.randn(300, generator=generator) for _ in range(2)]
        for i, (w, g) in enumerate(zip(mine, grads)):
            g = g.add(w, alpha=weight_decay) if weight_decay else g
            key = (step % 2, i)
            buffers[key] = g.clone() if key not in buffers else buffers[key].mul_(0.9).add_(g)
            w.add_(g.add(buffers[key], alpha=0.9), alpha=-0.1)
    for p, w in zip(params, mine):
        assert torch.equal(p.detach(), w)
    assert torch.equal(states[0]["momentum_1"], buffers[(1, 0)])
    if not weight_decay:  # the step's direction g + β·v was made in the gradient itself
        assert torch.equal(params[0].grad, grads[0].add(buffers[(0, 0)], alpha=0.9))

    class OwnSGD(torch.optim.SGD):  # a subclass steps as its own step says: not switched to foreach
        seen: list = []

        def step(self, closure=None):
            self.seen.append([group["foreach"] for group in self.param_groups])
            return super().step(closure)

    stepped(OwnSGD)
    assert OwnSGD.seen == [[None]] * 3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_servers_nesterov_step_in_half_precision_is_torchs_single_tensor_step(dtype):
    """foreach rounds β·v otherwise in half precision: there the step stays torch's single-tensor one, bit for bit."""
    from lightning_rudra.core.lookahead import step_with_learner_momenta

    def stepped(step):
        generator = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(300, generator=generator).to(dtype)) for _ in range(2)]
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True)
        for _ in range(4):
            for p in params:
                p.grad = torch.randn(300, generator=generator).to(dtype)
            step(opt, params)
        return params

    states: list[dict] = [{}, {}]  # learner 0's buffers, kept from step to step
    dana = stepped(lambda opt, params: step_with_learner_momenta(opt, params, states, [0]))
    single = stepped(lambda opt, params: opt.step())  # foreach=None: the single-tensor path on CPU
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(dana, single))


def test_the_foreach_setting_is_restored_when_the_step_fails():
    from lightning_rudra.core.lookahead import step_with_learner_momenta

    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9, nesterov=True)
    w.grad = torch.ones(3)

    def fails():
        assert opt.param_groups[0]["foreach"] is True  # the step runs by the foreach path
        raise RuntimeError("the step failed")

    opt.step = fails
    with pytest.raises(RuntimeError, match="the step failed"):
        step_with_learner_momenta(opt, [w], [{}], [0])
    assert opt.param_groups[0]["foreach"] is None
