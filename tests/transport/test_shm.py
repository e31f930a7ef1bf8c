"""Shared memory between the server and its host's learners, in-process: mapping, the sequence lock, cleanup."""

import os
import threading
import time

import pytest
import torch

from lightning_rudra.core.flat import FlatLayout
from lightning_rudra.core.protocol import OptimizerSpec, ProtocolConfig, Server
from lightning_rudra.transport.shm import MappedWeights, SharedWeights, shared_memory_refused
from lightning_rudra.core.update import Push


def shared_server(tmp_path, num_learners=1):
    params = [torch.zeros(3), torch.zeros(2, dtype=torch.float64)]
    buffers = [torch.ones(2)]
    store = SharedWeights("host", str(tmp_path))
    opt = torch.optim.SGD([torch.nn.Parameter(p.clone()) for p in params], lr=0.5)
    server = Server(
        ProtocolConfig(num_learners, "async"),
        params,
        buffers,
        [OptimizerSpec.from_optimizer(opt, list(opt.param_groups[0]["params"]))],
        store=store,
    )
    grads = store.allocate_grads(num_learners, server.grad_layouts)
    return server, store, grads, store.names(server.flat_params, server.flat_buffers, grads)


def mapping(names, learner=0, timeout=60.0, lost=lambda: None, pull=None):
    def unused():
        raise AssertionError("the sequence lock was enough: no read under the server's lock expected")

    return MappedWeights(names, learner, "the parameter server (on host)", timeout, lost, pull or unused)


def test_a_learner_sees_the_servers_updates_and_writes_the_gradient_the_server_reads(tmp_path):
    server, store, grads, names = shared_server(tmp_path)
    mapped = mapping(names)
    FlatLayout([torch.zeros(3), torch.zeros(2, dtype=torch.float64)]).pack_into(
        [torch.ones(3), torch.full((2,), 2.0, dtype=torch.float64)], mapped.grads[0]
    )
    assert [g.tolist() for g in grads[(0, 0)]] == [[1.0] * 3, [2.0] * 2]  # the same memory
    result = server.push(Push(0, 0, grads[(0, 0)], torch.ones(2, dtype=torch.bool), 0, [{"lr": 0.5}], [torch.ones(2)]))
    assert result.closed and server.clock == 1
    seen = {}
    clock = mapped.read(lambda params, buffers: seen.update(p=[p.clone() for p in params]))
    assert clock == 1 and [p.tolist() for p in seen["p"]] == [[-0.5] * 3, [-1.0] * 2]
    assert int(mapped.header[0]) % 2 == 0


def test_a_read_waits_while_the_server_writes_and_never_sees_half_an_update(tmp_path):
    server, store, _, names = shared_server(tmp_path)
    mapped = mapping(names)
    store.begin()  # the server is in the middle of an update
    store_params = server.flat_params[0]
    store_params.fill_(7.0)
    result = {}
    reader = threading.Thread(
        target=lambda: result.update(clock=mapped.read(lambda params, _: result.update(values=params[0].tolist())))
    )
    reader.start()
    time.sleep(0.2)
    assert reader.is_alive() and "values" not in result  # it waits for the version to become even
    store_params.fill_(9.0)
    store.end(5)
    reader.join(timeout=10)
    assert result == {"values": [9.0] * 3, "clock": 5}


def test_unlink_removes_every_file_and_mappings_stay_valid(tmp_path):
    server, store, _, names = shared_server(tmp_path, num_learners=2)
    mapped = mapping(names, 1)
    assert len(os.listdir(tmp_path)) == 1 + 2 + 1 + 2 * 2  # header, params, buffers, 2 learners' gradients
    store.unlink()
    assert os.listdir(tmp_path) == []
    server.flat_params[0].fill_(3.0)
    assert mapped.params[0].tolist() == [3.0] * 3


def test_shared_memory_that_cannot_be_allocated_is_reported_with_a_remedy(tmp_path):
    with pytest.raises(
        OSError,
        match=r"cannot allocate 3 x torch.int64 of shared memory at .*/missing/lightning_rudra"
        r".*shared_memory=False",
    ):
        SharedWeights("host", str(tmp_path / "missing"))


@pytest.mark.parametrize(
    "lost, timeout, message",
    [
        (
            lambda: "the parameter server (on host) is gone: its connection closed",
            60.0,
            r"^the parameter server \(on host\) is gone: its connection closed. It went in the middle of an update",
        ),
        (
            lambda: None,
            0.05,
            r"^the parameter server \(on host\) has been in the middle of an update of the weights in "
            r"shared memory for more than 0.05 s \(rpc_timeout\)",
        ),
    ],
)
def test_a_read_during_an_update_that_never_ends_fails_naming_the_server(tmp_path, lost, timeout, message):
    _, store, _, names = shared_server(tmp_path)
    reader = mapping(names, timeout=timeout, lost=lost)
    store.begin()  # and the server dies
    with pytest.raises(RuntimeError, match=message):
        reader.read(lambda params, buffers: None)


def test_a_learner_maps_only_the_servers_own_files(tmp_path):
    """Another /dev/shm: the files are missing (and none is created), or others stand at their paths."""
    _, store, _, names = shared_server(tmp_path)
    store.unlink()
    with pytest.raises(FileNotFoundError, match=names.header):
        mapping(names)
    assert os.listdir(tmp_path) == []
    _, other, _, _ = shared_server(tmp_path)  # another server's files at the paths of the first
    for old, new in zip(sorted(os.listdir(tmp_path)), sorted(names_of(names))):
        os.rename(tmp_path / old, new)
    with pytest.raises(OSError, match=f"{names.header} is not the file the server made"):
        mapping(names)


def names_of(names):
    return [names.header] + [
        path for files in (names.params, names.buffers, *names.grads.values()) for path, _, _ in files
    ]


def test_shared_memory_is_refused_on_weakly_ordered_cpus(monkeypatch, tmp_path):
    assert [shared_memory_refused(m) for m in ("x86_64", "AMD64", "i686")] == [None] * 3
    assert shared_memory_refused("aarch64") == (
        "shared memory is not used on this aarch64 CPU: its sequence lock is only correct on x86 (no memory fences)."
    )
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    with pytest.raises(OSError, match="not used on this aarch64 CPU"):
        SharedWeights("host", str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_a_slow_reader_of_a_server_updating_back_to_back_gets_a_consistent_copy(tmp_path):
    """Each update is short, but they follow each other with no gap: a reader whose copy is slower than one update
    is overtaken every time. It is not told that the server died (the version moves: the server lives), and, once
    overtaken a few times, it reads under the server's lock (as an RPC pull does)."""
    server, store, _, names = shared_server(tmp_path)
    lock, stop = threading.Lock(), threading.Event()
    updates = []

    def write() -> None:
        value = 0
        while not stop.is_set():
            with lock:
                value += 1
                store.begin()
                for flat in server.flat_params:
                    flat.fill_(value)
                store.end(value)
            updates.append(value)
            time.sleep(0)  # the next update follows at once

    def pull():
        with lock:
            return (
                [p.clone() for p in server.flat_params],
                [b.clone() for b in server.flat_buffers],
                int(store.header[1]),
            )

    def slow_copy(params, buffers):
        seen.clear()
        for flat in params:
            time.sleep(0.01)  # a big model: the copy takes longer than an update
            seen.extend(flat.tolist())

    seen: list = []
    writer = threading.Thread(target=write)
    writer.start()
    try:
        while len(updates) < 10:
            time.sleep(0.001)
        reader = mapping(names, timeout=0.05, pull=pull)  # longer than an update, shorter than the read
        clock = reader.read(slow_copy)
    finally:
        stop.set()
        writer.join()
    assert len(updates) > 20 and set(seen) == {float(clock)}  # one update's weights, the clock they came with


class WritesInProgress:
    """A header whose version is odd at every look, another update each time: a server so busy that a reader always
    catches it in the middle of one (its updates back to back, each longer than the reader's look)."""

    def __init__(self) -> None:
        self.looks = 0

    def __getitem__(self, index: int) -> int:
        if index != 0:
            return 0
        self.looks += 1
        if self.looks > 100:
            raise AssertionError("the read kept waiting through 100 updates in progress instead of pulling")
        return 2 * self.looks - 1


def test_a_reader_that_keeps_finding_updates_in_progress_pulls_after_a_few(tmp_path):
    """Each update the reader finds in progress is a new one (the version moves: the server lives, and is not
    called dead); the updates begun during the read count towards the few it waits for before it pulls."""
    server, _, _, names = shared_server(tmp_path)
    pulled = []

    def pull():
        pulled.append(True)
        return [p.clone() for p in server.flat_params], [b.clone() for b in server.flat_buffers], 7

    reader = mapping(names, timeout=60.0, pull=pull)
    reader.header = WritesInProgress()
    assert reader.read(lambda params, buffers: None) == 7
    assert pulled == [True] and reader.header.looks == 1 + 4  # the first look, then 4 updates begun since
