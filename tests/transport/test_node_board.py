"""The node's board (node-local aggregation) in one process: a member maps the leader's files (and only those), the
files go once mapped, two learners (threads) link their shards to the server they reach through RPC (or, when one
cannot map the board, turn aggregation off with a warning), and a round through :class:`~lightning_rudra.learner.node.NodeMember`: the leader sums, sends once
and writes the reply's weights, which the member reads. Every wait ends with an error naming the learner waited for
when it ended, stopped pushing or went silent."""

import subprocess
import threading

import pytest
import torch

from lightning_rudra.core.node_plan import NodeGroup
from lightning_rudra.core.update import Push, PushReply
from lightning_rudra.learner.node import NodeMember
from lightning_rudra.transport.node_board import BEAT, PID, NodeBoard, board_layout
from torch.futures import Future


def layout(members=(0, 1)):
    return board_layout(members, [{torch.float32: 3}], [2], {torch.float32: 3}, {torch.float32: 1})


def test_a_member_maps_the_leaders_files_which_then_go(tmp_path):
    board = NodeBoard.create(layout(), str(tmp_path))
    mapped = NodeBoard.open(layout(), board.names)
    mapped.params[0][:] = 5.0
    assert board.params[0].tolist() == [5.0] * 3  # the same memory
    board.unlink()
    assert list(tmp_path.iterdir()) == []
    assert mapped.params[0].tolist() == [5.0] * 3  # the mapping stays valid


def test_a_file_that_is_not_the_leaders_is_refused(tmp_path):
    board = NodeBoard.create(layout(), str(tmp_path))
    names = board.names
    board.header[0] += 1  # another board in its place
    with pytest.raises(OSError, match="token differs"):
        NodeBoard.open(layout(), names)
    board.unlink()


class Client:
    timestamp = 0

    def receive(self, future):
        return future.wait()


def links(tmp_path, timeout=5.0):
    leader_board = NodeBoard.create(layout(), str(tmp_path))
    member_board = NodeBoard.open(layout(), leader_board.names)
    leader_board.unlink()
    group = NodeGroup(0, 1, (0, 1))
    return NodeMember(group, 0, leader_board, timeout, "parameter server 1"), NodeMember(
        group, 1, member_board, timeout, "parameter server 1"
    )


def node_push(learner, grads, has_grad, buffers):
    """A learner's finite gradient for optimizer 0, as it hands it to its node."""
    return Push(learner, 0, grads, has_grad, 0, [{"lr": 0.1}], buffers, True)


def test_a_round_the_leader_sums_and_sends_once_the_member_reads_the_weights(tmp_path):
    leader, member = links(tmp_path)
    sent = []

    def send(push):
        sent.append(
            (push.grads[0].tolist(), push.has_grad.tolist(), push.buffers[0].tolist(), push.members, push.refused)
        )
        future = Future()
        future.set_result(PushReply("accepted", 0, 1.0, [torch.tensor([9.0, 8.0, 7.0])], [torch.tensor([0.5])], 3))
        return future

    def member_round():
        member.push(
            node_push(1, [torch.tensor([1.0, 1.0, 1.0])], torch.tensor([False, True]), [torch.tensor([2.0])]),
            send,
            lambda: None,
        )
        replies.append(member.receive(Client(), None, lambda: None))

    replies = []
    thread = threading.Thread(target=member_round)
    thread.start()
    future = leader.push(
        node_push(0, [torch.tensor([1.0, 2.0, 3.0])], torch.tensor([True, False]), [torch.tensor([1.0])]),
        send,
        lambda: None,
    )
    leader_reply = leader.receive(Client(), future, lambda: None)
    thread.join(10)
    assert sent == [([2.0, 3.0, 4.0], [True, True], [3.0], [1], [])]
    [reply] = replies
    assert reply.params[0].tolist() == [9.0, 8.0, 7.0] and reply.buffers[0].tolist() == [0.5]
    assert (reply.status, reply.clock, leader_reply.clock) == ("accepted", 3, 3)
    leader.close(False)
    member.close(False)


def test_the_leader_names_a_member_that_ended_or_stopped_pushing(tmp_path):
    leader, member = links(tmp_path)
    ended = subprocess.Popen(["true"])
    ended.wait()
    member.slot.control[PID] = ended.pid
    push = (node_push(0, [torch.zeros(3)], torch.tensor([True, True]), [torch.zeros(1)]), None, lambda: None)
    with pytest.raises(RuntimeError, match=r"learner 1 \(on this node, process \d+\) ended while learner 0 waited"):
        leader.push(*push)
    member.slot.control[PID] = 0
    member.close(False)
    with pytest.raises(RuntimeError, match="learner 1 .* stopped pushing"):
        leader.push(*push)
    leader.close(True)


def test_a_member_names_a_leader_that_failed_or_went_silent(tmp_path):
    leader, member = links(tmp_path, timeout=0.6)
    leader._stop.set()  # its heartbeat stops, as a stopped process's would
    leader.slot.control[BEAT] += 1
    member.push(node_push(1, [torch.zeros(3)], torch.tensor([True, True]), [torch.zeros(1)]), None, lambda: None)
    with pytest.raises(RuntimeError, match=r"learner 0 .* no sign of life for more than 0.6 s \(rpc_timeout\)"):
        member.receive(Client(), None, lambda: None)
    leader.close(True)
    with pytest.raises(RuntimeError, match="learner 0 .* failed while learner 1 waited for the weights"):
        member.receive(Client(), None, lambda: None)
    member.close(True)


def test_a_wait_ends_with_what_another_servers_reply_failed_with(tmp_path):
    leader, member = links(tmp_path)

    def check():
        raise RuntimeError("learner 3 (on 10.0.0.2) has not been heard from")

    with pytest.raises(RuntimeError, match="learner 3"):
        leader.push(node_push(0, [torch.zeros(3)], torch.tensor([True, True]), [torch.zeros(1)]), None, check)
    leader.close(True)
    member.close(True)


class Gathering:
    """The collectives of two learners in two threads (what the server's gather gives each)."""

    def __init__(self, learners):
        self.barrier = threading.Barrier(learners)
        self.objects = {}
        self.lock = threading.Lock()

    def client(self, rank):
        def gather(obj):
            self.barrier.wait(10)
            with self.lock:
                self.objects[rank] = obj
            self.barrier.wait(10)
            out = dict(sorted(self.objects.items()))
            self.barrier.wait(10)
            return out

        return gather


class Stub:
    def __init__(self, rank):
        self.rank = rank
        self.timestamp = 0
        self.what = "parameter server 1"


def learners_of_one_node():
    from lightning_rudra.learner.learner import Learner

    made = []
    for rank in range(2):
        module = torch.nn.Linear(3, 2)
        learner = Learner(module, [Stub(rank), Stub(rank)])
        learner.links[0].shm = object()  # server 0 is on this host; server 1 is reached through RPC
        learner.wrap([torch.optim.SGD(module.parameters(), lr=0.1)])
        made.append(learner)
    return made


def test_the_learners_of_a_node_link_their_shards_to_the_servers_they_reach_through_rpc(tmp_path, monkeypatch):
    from lightning_rudra.learner.node import aggregate

    monkeypatch.setenv("LIGHTNING_RUDRA_SHM_DIR", str(tmp_path))
    learners = learners_of_one_node()
    gathering, groups = Gathering(2), {}

    def run(rank):
        groups[rank] = aggregate(learners[rank], gathering.client(rank), 0, 5.0, rank == 0)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert groups[0] == groups[1] == [NodeGroup(0, 1, (0, 1))]
    assert [learner.links[1].node.leader for learner in learners] == [True, False]
    assert all(learner.links[0].node is None for learner in learners)
    assert list(tmp_path.iterdir()) == []  # every file went once mapped
    for learner in learners:
        learner.links[1].node.close(False)


def test_a_member_that_cannot_map_the_board_turns_aggregation_off_with_a_warning(tmp_path, monkeypatch):
    from lightning_rudra.learner import node

    monkeypatch.setenv("LIGHTNING_RUDRA_SHM_DIR", str(tmp_path))

    def refuse(layout, names):
        raise OSError("another /dev/shm")

    monkeypatch.setattr(node.NodeBoard, "open", refuse)
    learners = learners_of_one_node()
    gathering, groups, warned = Gathering(2), {}, []

    monkeypatch.setattr(node.warnings, "warn", lambda message, *args, **kwargs: warned.append(message))

    def run(rank):
        groups[rank] = node.aggregate(learners[rank], gathering.client(rank), 0, 5.0, rank == 0)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert groups == {0: [], 1: []}
    assert warned == [
        "lightning_rudra: node-local aggregation is off: learner 1 could not map the shared memory of learner 0 on "
        "its node: another /dev/shm. Each learner pushes alone."
    ]
    assert all(learner.links[1].node is None for learner in learners)
    assert list(tmp_path.iterdir()) == []
