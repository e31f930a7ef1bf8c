"""The model cut for several servers (``num_servers``), in-process: the cuts, the optimizer states split and merged
at them, and what is refused. Over real RPC: test_rpc.py (hardsync and async exact with 2 and 3 servers),
test_strategy.py (a checkpoint taken with one number of servers resumed with another), test_hosts.py (one server
per host, the default)."""

import copy

import pytest
import torch

from lightning_rudra import RudraStrategy
from lightning_rudra.learner.learner import Learner
from lightning_rudra.core.compensation import RULES_STATE
from lightning_rudra.core.optimizers import OptimizerSpec, sharing_parameters
from lightning_rudra.core.protocol import ProtocolConfig, Server
from lightning_rudra.core.shards import ShardPlan
from lightning_rudra.core.update import Push
from tests.lightning_models import quiet_trainer

SHAPES = [torch.Size([4, 5]), torch.Size([5]), torch.Size([0]), torch.Size([3, 2])]  # 20 + 5 + 0 + 6 = 31


@pytest.mark.parametrize("num_shards", [1, 2, 3, 31])
def test_the_cuts_cover_every_element_once_in_nearly_equal_parts(num_shards):
    plan = ShardPlan(SHAPES, num_shards)
    sizes = [sum(p.stop - p.start for p in pieces) for pieces in plan.shards]
    assert sum(sizes) == 31 and max(sizes) - min(sizes) <= 1
    tensors = [torch.arange(s.numel(), dtype=torch.float32).reshape(s) + 100 * i for i, s in enumerate(SHAPES)]
    parts = [view.reshape(-1) for shard in range(num_shards) for view in plan.views(shard, tensors)]
    assert torch.equal(torch.cat(parts), torch.cat([t.reshape(-1) for t in tensors]))  # in order, no overlap
    whole = [view for view in plan.views(0, tensors) if view.shape == SHAPES[0]]
    assert num_shards > 1 or len(whole) == 1 and whole[0] is tensors[0]  # one server: the tensors themselves
    assert plan.splits_a_parameter == (num_shards > 1)


def test_views_of_a_parameter_write_through_to_it():
    weight = torch.zeros(4, 5)
    [first, _] = [ShardPlan([weight.shape], 2).views(shard, [weight])[0] for shard in range(2)]
    first.copy_(torch.ones(10))
    assert weight.sum() == 10 and weight[:2].eq(1).all()


@pytest.mark.parametrize(
    "cls, options", [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), (torch.optim.Adam, {"lr": 0.01})]
)
def test_optimizer_states_split_at_the_cuts_step_as_the_whole_and_merge_back(cls, options):
    """Each server's optimizer over its slices, stepped on the slices of one gradient, ends with exactly the
    whole optimizer's weights and state; the state merged from the servers loads into the whole optimizer."""
    torch.manual_seed(0)
    params = [torch.randn(s, requires_grad=True) for s in SHAPES]
    grads = [torch.randn(s) for s in SHAPES]
    whole = cls([{"params": params[:2]}, {"params": params[2:], "lr": 0.5}], **options)
    spec = OptimizerSpec.from_optimizer(whole, params)
    order = [i for idx, _ in spec.groups for i in idx]
    plan = ShardPlan(SHAPES, 3)
    slices = [[v.detach().clone().requires_grad_() for v in plan.views(s, params)] for s in range(3)]
    shards = {s: plan.spec(s, spec).build(slices[s]) for s in range(3)}
    for step in range(2):
        for p, g in zip(params, grads):
            p.grad = g * (step + 1)
        whole.step()
        for s, optimizer in shards.items():
            for p, g in zip(slices[s], plan.views(s, [g * (step + 1) for g in grads])):
                p.grad = g.clone()
            optimizer.step()
    merged = torch.cat([p.detach().reshape(-1) for s in range(3) for p in slices[s]])
    assert torch.equal(merged, torch.cat([p.detach().reshape(-1) for p in params]))
    state = plan.merge_states(order, {s: optimizer.state_dict() for s, optimizer in shards.items()})
    expected = whole.state_dict()["state"]
    assert state["state"].keys() == expected.keys()
    for position, entry in expected.items():
        for key, value in entry.items():
            assert torch.equal(state["state"][position][key], value), (position, key)
    for s, optimizer in shards.items():  # and split again: what each server loads on resume
        optimizer.load_state_dict(plan.split_state(s, order, whole.state_dict()))


def test_the_compensation_rules_state_splits_at_the_cuts_and_merges_back():
    """The running means of ``dc`` and ``gap`` (beside the optimizer's own state, one entry per parameter): each
    server loads its slices of them, and the merged state is the whole again, whatever the number of servers."""
    torch.manual_seed(0)
    params = [torch.randn(s) for s in SHAPES]
    spec = OptimizerSpec.from_optimizer(torch.optim.Adam([{"params": params[:2]}, {"params": params[2:]}]), params)
    order = [i for idx, _ in spec.groups for i in idx]
    rules = {
        k: {"dc_mean_square": torch.rand(SHAPES[i]), "gap_step": torch.rand(SHAPES[i])} for k, i in enumerate(order)
    }
    whole = {"state": {RULES_STATE: rules}, "param_groups": [{"params": [0, 1]}, {"params": [2, 3]}]}
    for num_shards in (2, 3):
        plan = ShardPlan(SHAPES, num_shards)
        states = {s: plan.split_state(s, order, whole) for s in range(num_shards)}
        for s, state in states.items():
            sliced = plan.views(s, [rules[order.index(i)]["gap_step"] for i in range(len(SHAPES))])
            kept = state["state"][RULES_STATE]
            assert [kept[k]["gap_step"].reshape(-1).tolist() for k in sorted(kept)] == [
                t.reshape(-1).tolist() for t in sliced
            ]
        merged = plan.merge_states(order, states)["state"][RULES_STATE]
        assert merged.keys() == rules.keys()
        for k, entry in rules.items():
            for key, value in entry.items():
                assert torch.equal(merged[k][key], value), (num_shards, k, key)


def test_a_non_elementwise_optimizer_or_a_non_contiguous_parameter_is_not_cut():
    """The cuts then fall between parameters, at the boundaries nearest to the even ones: a part may be empty."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 6))  # 20, 5, 30, 6 elements
    learner = Learner(model, [object(), object(), object()])
    assert learner.plan.splits_a_parameter
    learner.check([torch.optim.Adam(model.parameters())])
    assert learner.plan.splits_a_parameter  # elementwise: cut anywhere
    learner.check([torch.optim.Adafactor(model.parameters())])  # factors each matrix: whole parameters
    assert [[(p.param, p.whole) for p in pieces] for pieces in learner.plan.shards] == [
        [(0, True)],
        [(1, True)],
        [(2, True), (3, True)],
    ]  # cuts at 20 and 25, the nearest to 20.3 and 40.7
    assert [len(link.params) for link in learner.links] == [1, 1, 2]
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    plan = Learner(conv, [object(), object()]).plan
    assert not plan.splits_a_parameter and [len(pieces) for pieces in plan.shards] == [1, 1]
    # one parameter of 10 elements, 3 servers: the boundaries nearest to the cuts 3 and 6 are 0 and 10
    assert [len(pieces) for pieces in ShardPlan([torch.Size([10])], 3, whole=True).shards] == [0, 1, 0]


def test_refusals_name_the_value_and_what_to_do():
    with pytest.raises(ValueError, match=r"num_servers=40 is more than the model's 31 parameter elements"):
        ShardPlan(SHAPES, 40)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=rf"num_servers={bad!r} is not valid: expected an integer >= 1"):
            RudraStrategy(num_servers=bad)
    with pytest.raises(ValueError, match=r"num_servers=2 has no meaning with simulate=4"):
        quiet_trainer(RudraStrategy(simulate=4, num_servers=2), 1)


def test_every_server_counts_the_updates_of_an_optimizer_that_shares_a_parameter_held_elsewhere():
    """Optimizer 0 holds a, optimizer 1 holds a and b; the server of b alone must count optimizer 0's updates as
    changing optimizer 1's weights too, as the server of a does: every server gives a gradient the same σ."""
    a, b = torch.zeros(3), torch.zeros(2)
    specs = sharing_parameters(
        [OptimizerSpec.from_optimizer(torch.optim.SGD(group, lr=1.0), [a, b]) for group in ([a], [a, b])]
    )
    plan = ShardPlan([a.shape, b.shape], 2, whole=True)
    assert [[p.param for p in pieces] for pieces in plan.shards] == [[0], [1]]
    servers = [
        Server(ProtocolConfig(2, "async"), plan.views(s, [a.clone(), b.clone()]), [], [plan.spec(s, x) for x in specs])
        for s in range(2)
    ]
    # learner 1 steps optimizer 0, then learner 0 optimizer 1 from the same weights (learner 0's own step would
    # be no staleness to it)
    for optimizer, learner in ((0, 1), (1, 0)):
        sigmas = []
        for server in servers:
            grads = [torch.ones_like(server.params[i]) for i in server.optimizer_params[optimizer]]
            has_grad = torch.ones(len(grads), dtype=torch.bool)
            result = server.push(
                Push(learner, optimizer, server.grad_layouts[optimizer].pack(grads), has_grad, 0, [{"lr": 1.0}], [])
            )
            sigmas.append(result.staleness)
        assert sigmas == [optimizer, optimizer]


def test_the_rules_state_resumes_exactly_with_another_number_of_servers():
    """dc and gap with Adam on 2 servers, their state merged into one checkpoint and resumed on 3: the same weights
    as the 2 servers that went on."""
    torch.manual_seed(0)
    start = [torch.randn(s) for s in SHAPES]
    spec = OptimizerSpec.from_optimizer(torch.optim.Adam(start, lr=0.1), start)
    groups = torch.optim.Adam(start, lr=0.1).state_dict()["param_groups"]
    order = [i for idx, _ in spec.groups for i in idx]
    config = ProtocolConfig(2, "async", compensation="dc+gap")
    grads = [[torch.randn(s) for s in SHAPES] for _ in range(6)]

    def servers(num, weights, stats=None):
        plan = ShardPlan(SHAPES, num)
        return plan, [
            Server(config, [v.clone() for v in plan.views(s, weights)], [], [plan.spec(s, spec)], copy.deepcopy(stats))
            for s in range(num)
        ]

    def push(plan, cut, learner, grad, timestamp):
        for s, server in enumerate(cut):
            local = [g.clone() for g in plan.views(s, grad)]
            has_grad = torch.ones(len(local), dtype=torch.bool)
            server.push(Push(learner, 0, server.grad_layouts[0].pack(local), has_grad, timestamp, [{"lr": 0.1}], []))

    def weights(cut):
        flat = torch.cat([p.reshape(-1) for server in cut for p in server.params])
        return [t.view(s) for t, s in zip(flat.split([s.numel() for s in SHAPES]), SHAPES)]

    plan, two = servers(2, start)
    for k, (learner, timestamp) in enumerate([(0, 0), (1, 0), (0, 1)]):
        push(plan, two, learner, grads[k], timestamp)
    merged = plan.merge_states(order, {s: server.optimizer_state(0) for s, server in enumerate(two)})
    saved = copy.deepcopy({**merged, "param_groups": groups})
    assert set(saved["state"][RULES_STATE]) == set(range(len(SHAPES)))
    plan3, three = servers(3, weights(two), two[0].stats)
    for s, server in enumerate(three):  # each its own copy, as over RPC (Adam's step counts are shared otherwise)
        server.load_optimizer_state(0, copy.deepcopy(plan3.split_state(s, order, saved)))
    clock = two[0].clock
    for k, (learner, timestamp) in enumerate([(0, clock), (1, clock), (0, clock + 1)]):
        push(plan, two, learner, grads[3 + k], timestamp)
        push(plan3, three, learner, grads[3 + k], timestamp)
    for went_on, resumed in zip(weights(two), weights(three)):
        assert torch.equal(went_on, resumed)
