"""The model cut for several servers (``num_servers``), in-process: the cuts, the optimizer states split and merged
at them, and what is refused. Over real RPC: test_rpc.py (hardsync and async exact with 2 and 3 servers),
test_strategy.py (a checkpoint taken with one number of servers resumed with another), test_hosts.py (one server
per host, the default)."""

import pytest
import torch

from lightning_rudra import RudraStrategy
from lightning_rudra.learner.learner import Learner
from lightning_rudra.core.compensation import RULES_STATE
from lightning_rudra.core.optimizers import OptimizerSpec
from lightning_rudra.core.shards import ShardPlan
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
    assert [len(shard.params) for shard in learner.shards] == [1, 1, 2]
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
