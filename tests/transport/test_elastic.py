"""What a starting learner reads in an elastic run's store before it joins (a real TCP store on this machine, no
RPC): one of the first processes, a process taking a lost learner's place, or one that is refused."""

import json
import pickle
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.distributed.rpc as rpc

from lightning_rudra.learner import world
from lightning_rudra.learner.world import _incarnation
from lightning_rudra.server.membership import this_process
from lightning_rudra.transport.elastic import LearnerId, RunStore, forget_before_joining, incarnation_of
from lightning_rudra.transport.rpc_world import free_port, rpc_counters


@pytest.fixture
def store(monkeypatch):
    for variable in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(variable, raising=False)
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5))
    run = RunStore("127.0.0.1", port, timeout=2.0)
    run.publish("job", "")
    run.publish("rpc_counters", rpc_counters())
    yield run
    del master


def test_a_first_process_joins_as_itself(store):
    assert _incarnation(store, 1, "here") == 0


def test_a_process_for_a_lost_learner_takes_a_new_incarnation(store):
    store.mark(1, "lost", "ended before training did")
    assert _incarnation(store, 1, "here") == 1
    assert _incarnation(store, 1, "here") == 2  # each process its own: a name and RPC rank no process had


@pytest.mark.slow  # waits for seconds
def test_a_process_for_a_live_learner_is_refused(store, monkeypatch):
    monkeypatch.setattr(world, "_COUNTING_S", 0.0)  # refused once the server had rpc_timeout (2 s) to count it
    store.mark(1, "alive", json.dumps(["another-machine", 4321]))
    with pytest.raises(RuntimeError, match=r"learner 1 of the run at here is alive \(process 4321\)"):
        _incarnation(store, 1, "here")
    store.mark(1, "alive", json.dumps([this_process()[0], this_process()[1]]))  # alive here: this very process
    with pytest.raises(RuntimeError, match="is alive"):
        _incarnation(store, 1, "here")


def test_a_process_of_another_run_is_refused(store, monkeypatch):
    store.arrive(1)  # the run's first members have all joined
    with pytest.raises(RuntimeError, match="under way with all its learners, and learner 1 was never lost there"):
        _incarnation(store, 1, "here")
    store.mark(1, "lost", "ended before training did")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    with pytest.raises(RuntimeError, match=r"this process \(job 77\) cannot take learner 1's place .* job none"):
        _incarnation(store, 1, "here")


def test_a_learner_id_carries_its_incarnation_through_pickling():
    learner = pickle.loads(pickle.dumps(LearnerId(3, 2)))
    assert learner == 3 and incarnation_of(learner) == 2 and incarnation_of(3) == 0
    assert {learner: "x"}[3] == "x"  # a key like the int


def test_a_new_process_strikes_its_learners_earlier_processes_before_it_joins(store):
    """One that died after joining the world, before any server knew of it, is still listed: a join would call it."""
    world = dist.PrefixStore(f"rpc_prefix_{rpc._init_counter}", store.store)
    world.set("RpcGroupManagementToken", "")
    world.set("names/_ALL_WORKER_INFOS", "server-0,learner0-1,learner1-2,learner10-11,learner1_3-5,")
    forget_before_joining(store, 1)
    assert world.get("names/_ALL_WORKER_INFOS").decode() == "server-0,learner0-1,learner10-11,"
    assert world.get("RpcGroupManagementToken").decode() == ""  # handed back


def test_a_process_for_a_learner_of_another_machine_waits_for_the_server_to_count_it_lost(store):
    """Its pid cannot be checked from here: the server decides, after rpc_timeout of silence."""
    store.mark(1, "alive", json.dumps(["another-machine", 4321]))
    threading.Timer(0.5, store.mark, args=(1, "lost", "has not been heard from for more than 2 s")).start()
    assert _incarnation(store, 1, "here") == 1
