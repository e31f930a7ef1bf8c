"""Node-local aggregation's plain-torch pieces: the plan (which nodes sum their pushes to which server), the node's
sum, and the server counting a node's push as the gradients of each of its learners: the update equals the one of
the same gradients pushed one by one."""

import pytest
import torch

from lightning_rudra.core.node_plan import LearnerPlace, NodeGroup, plan_nodes, refusal, sum_node
from lightning_rudra.core.update import Push
from tests.core.test_protocol import make_server


def place(rank, node, host="a", remote=(1,)):
    return LearnerPlace(rank, node, host, remote)


def test_the_plan_groups_a_nodes_learners_for_the_servers_they_all_reach_through_rpc():
    places = [place(0, 0, "a", (1,)), place(1, 0, "a", (1,)), place(2, 1, "b", (0,)), place(3, 1, "b", (0,))]
    assert plan_nodes(places) == [NodeGroup(0, 1, (0, 1)), NodeGroup(1, 0, (2, 3))]
    assert plan_nodes(places)[1].leader == 2


def test_the_plan_leaves_out_single_learners_mixed_host_names_and_servers_one_member_maps():
    assert plan_nodes([place(0, 0), place(1, 1)]) == []  # one learner per node
    assert plan_nodes([place(0, 0, "a"), place(1, 0, "b")]) == []  # one "node", two host names
    # learner 1 mapped server 1's shared memory (same host): nothing to aggregate towards it
    assert plan_nodes([place(0, 0, remote=(1, 2)), place(1, 0, remote=(2,))]) == [NodeGroup(0, 2, (0, 1))]
    assert plan_nodes([place(0, 0, remote=()), place(1, 0, remote=())]) == []  # one host: shared memory


def test_the_node_sum_adds_gradients_and_float_buffers_and_leaves_out_nonfinite_members():
    grads = [[torch.tensor([1.0, 2.0])], [torch.tensor([float("nan"), 0.0])], [torch.tensor([3.0, 4.0])]]
    has = [torch.tensor([True, False]), torch.tensor([True, True]), torch.tensor([False, True])]
    buffers = [[torch.tensor([1.0]), torch.tensor([7])], [torch.tensor([5.0]), torch.tensor([8])]] + [
        [torch.tensor([2.0]), torch.tensor([9])]
    ]
    total, has_grad, summed, refused = sum_node(grads, has, buffers, [True, False, True])
    assert total[0].tolist() == [4.0, 6.0] and has_grad.tolist() == [True, True]
    assert summed[0].tolist() == [3.0] and summed[1].tolist() == [7]  # integer buffers: the first member's
    assert refused == [1]
    assert grads[0][0].tolist() == [1.0, 2.0]  # the members' tensors are left as they were
    total, _, _, refused = sum_node(grads[1:2], has[1:2], buffers[1:2], [False])
    assert total[0].tolist() == [0.0, 0.0] and refused == [0]


def node_push(server, learner, grad, members=(), refused=(), buffers=()):
    return server.push(
        Push(
            learner,
            0,
            [torch.tensor(grad, dtype=torch.float32)],
            torch.tensor([True]),
            0,
            [{"lr": 0.1, "momentum": 0.0}],
            server.buffer_layout.pack([torch.tensor(b) for b in buffers]),
            None,
            members,
            refused,
        )
    )


def test_a_nodes_push_counts_as_each_learners_gradient_in_the_hardsync_mean():
    alone, nodes = make_server("hardsync", learners=4, momentum=0.9), make_server("hardsync", learners=4, momentum=0.9)
    grads = [[1.0, 0.0], [2.0, 1.0], [3.0, -1.0], [0.5, 4.0]]
    for _ in range(2):
        for learner, grad in enumerate(grads):
            node_push(alone, learner, grad)
        assert not node_push(nodes, 0, [3.0, 1.0], members=[1]).closed  # learners 0 and 1 summed
        result = node_push(nodes, 2, [3.5, 3.0], members=[3])
        assert result.closed and result.update.staleness == (0, 0, 0, 0)
    torch.testing.assert_close(nodes.params[0], alone.params[0], rtol=0, atol=1e-6)
    assert nodes.stats.gradients == alone.stats.gradients == 8 and nodes.stats.staleness == {0: 8}


def test_a_nodes_push_averages_the_buffers_over_every_learner():
    buffer = torch.zeros(1)
    server = make_server("hardsync", learners=3, buffers=[buffer])
    node_push(server, 0, [1.0, 1.0], members=[1], buffers=[[4.0]])  # the sum of two learners' buffers
    node_push(server, 2, [1.0, 1.0], buffers=[[5.0]])
    assert server.flat_buffers[0].tolist() == [3.0]


def test_a_refused_member_counts_as_rejected_and_the_others_average():
    server = make_server("hardsync", learners=3)
    node_push(server, 0, [3.0, 0.0], members=[1], refused=[1])  # learner 1's gradient was not finite
    result = node_push(server, 2, [1.0, 2.0])
    assert result.closed and server.stats.rejected == 1 and server.stats.gradients == 3
    assert server.params[0].tolist() == pytest.approx([-0.2, -0.1])  # -0.1 * mean of the 2 finite ones


def test_a_nodes_push_is_refused_where_it_does_not_apply():
    server = make_server("hardsync", learners=3)
    with pytest.raises(ValueError, match="not one each"):
        node_push(server, 0, [1.0, 1.0], members=[0])
    with pytest.raises(ValueError, match="learner 7 is unknown"):
        node_push(server, 0, [1.0, 1.0], members=[7])
    with pytest.raises(ValueError, match=r"members=\[True\] from learner 0 is not valid: expected a list of"):
        node_push(server, 0, [1.0, 1.0], members=[True])
    with pytest.raises(ValueError, match=r"refused=\[True\] from learner 0 is not valid: expected a list of"):
        node_push(server, 0, [1.0, 1.0], members=[1], refused=[True])
    node_push(server, 1, [1.0, 1.0])
    with pytest.raises(RuntimeError, match="learner 1 pushed twice"):
        node_push(server, 0, [1.0, 1.0], members=[1])
    assert server.stats.gradients == 1
    with pytest.raises(ValueError, match="only for hardsync"):
        node_push(make_server("async", learners=2), 0, [1.0, 1.0], members=[1])
    raising = make_server("hardsync", learners=2, nonfinite="raise")
    with pytest.raises(FloatingPointError, match="learner 1 pushed a gradient with NaN"):
        node_push(raising, 0, [1.0, 1.0], members=[1], refused=[1])


def test_what_refuses_aggregation():
    assert refusal("hardsync", None, None) is None
    assert "hardsync" in refusal("async", None, None)
    assert "min_learners=2" in refusal("hardsync", 2, None)
    assert "simulate=4" in refusal("hardsync", None, 4)
