"""The RPC world of an elastic run (``min_learners``): processes may leave it, and new ones join while it trains.

torch's static RPC world (a ``world_size``) is fixed at its first all-gather: a process started later cannot enter
it. Its dynamic world (``world_size=None``) lets one in, under two conditions this module keeps: a joining process
calls every member listed in the store, so a lost one must be struck from that list first (:func:`forget`), and a
joining process holds the store's group token while it joins, so one that dies or fails inside leaves every later
join waiting (:func:`release_stuck_token`). A learner's first process is ``learner<r>`` with RPC rank r + 1; each
later one (a restart, or a process started by hand for a lost rank) is ``learner<r>_<k>`` with a rank no process
had, since the server's agent keeps a dead peer's connection under its old rank.

The run's own keys live in the rendezvous' store (:class:`RunStore`), where a process that starts reads, before it
joins, whether its rank is lost (it rejoins), alive (it is refused) or neither (it is one of the first).
"""

import json
import os
import threading
import time
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist
import torch.distributed.rpc as rpc

_TOKEN = "RpcGroupManagementToken"  # torch's key (torch.distributed.rpc._utils) for who may join or leave now
_WORKERS = "names/_ALL_WORKER_INFOS"  # torch's list of the members, "name-rank," each, in the agent's store
_CONNECT_S = 300.0
_PROBE_S = 10.0  # for an answer from what holds the rendezvous' port
_STUCK_S = 10.0  # a join takes a fraction of a second; one that holds the token this long has died or failed inside


class LearnerId(int):
    """A learner's number as its calls carry it, with which of its processes calls: 0 for the first, a rejoining
    one's incarnation (:meth:`RunStore.next_incarnation`) after. The server refuses an earlier process's calls."""

    incarnation: int

    def __new__(cls, learner: int, incarnation: int = 0) -> "LearnerId":
        self = super().__new__(cls, learner)
        self.incarnation = incarnation
        return self

    def __reduce__(self) -> tuple:
        return LearnerId, (int(self), self.incarnation)


def incarnation_of(learner: Any) -> int:
    return getattr(learner, "incarnation", 0)


class RunStore:
    """The run's keys in the rendezvous' TCP store at host:port (a client connection)."""

    def __init__(self, host: str, port: int, timeout: float, connect: float = _CONNECT_S) -> None:
        self.timeout = timeout
        # the first server may take long to start (imports on a busy machine): wait for it as torch's own
        # rendezvous does, then keep to the run's timeout
        self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=max(timeout, connect)))
        self.store.set_timeout(timedelta(seconds=timeout))

    def _get(self, key: str) -> Optional[str]:
        full = f"lightning_rudra/{key}"
        return self.store.get(full).decode() if self.store.check([full]) else None

    def _set(self, key: str, value: str) -> None:
        self.store.set(f"lightning_rudra/{key}", value)

    def status(self, learner: int) -> tuple[str, str]:
        """``("lost", why)``, ``("alive", which process)`` or ``("new", "")`` for a process starting as
        ``learner``."""
        for state in ("lost", "alive"):
            value = self._get(f"{state}/{learner}")
            if value:
                return state, value
        return "new", ""

    def mark(self, learner: int, state: str, value: str) -> None:
        """``state`` is "lost" (``value``: why) or "alive" (``value``: its process); the other is cleared."""
        self._set(f"{state}/{learner}", value)
        self._set(f"{'alive' if state == 'lost' else 'lost'}/{learner}", "")

    def next_incarnation(self) -> int:
        """A number no process of this run had: the suffix of a rejoining process's RPC name, and its rank's."""
        return self.store.add("lightning_rudra/incarnations", 1)

    def publish(self, name: str, value: Any) -> None:
        self._set(name, json.dumps(value))

    def read(self, name: str) -> Any:
        """A value :meth:`publish` set; waits for it (the store's timeout)."""
        self.store.wait([f"lightning_rudra/{name}"])
        return json.loads(self._get(name) or "null")

    def joined(self) -> bool:
        """Every first member has joined: the run is under way."""
        return self._get("all_joined") is not None

    def arrive(self, total: int) -> None:
        """The first members meet here once each has joined, so that no call goes to a member not yet there."""
        if self.store.add("lightning_rudra/joined", 1) == total:
            self._set("all_joined", "1")
        # as long as a static world's first members wait for each other: a process may start slowly
        self.store.wait(["lightning_rudra/all_joined"], timedelta(seconds=max(self.timeout, _CONNECT_S)))


def run_at(host: str, port: int, timeout: float) -> Optional[RunStore]:
    """The store of the elastic run whose first server listens on host:port, or None if what listens there is not
    one. Bounded: torch's store client waits forever on a listener that never answers, so it connects in a thread
    that is left behind (blocked, a daemon) if it does not."""
    found: list[RunStore] = []

    def connect() -> None:
        try:
            store = RunStore(host, port, timeout, connect=_PROBE_S)
            if store._get("job") is not None:  # the first server publishes it before any learner joins
                found.append(store)
        except Exception:  # not a store, or not one that answers
            pass

    thread = threading.Thread(target=connect, name="rudra-run-probe", daemon=True)
    thread.start()
    thread.join(_PROBE_S)
    return found[0] if found else None


def job_id() -> str:
    """The scheduler's name for this job (SLURM, torchrun), or "" outside one."""
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or ""


def _agent_store() -> Any:
    return rpc.api._get_current_rpc_agent().store  # type: ignore[attr-defined]  # TensorPipeAgent's, undeclared


def forget(learner: int, store: Any = None) -> None:
    """Strike every process of ``learner`` (``learner<r>``, ``learner<r>_<k>``) from the world's list of members,
    under the group token, so that a process joining later does not call them. ``store``: the RPC world's (default:
    this process's agent's)."""
    store = store if store is not None else _agent_store()
    mine = f"Token_for_forget_{learner}_{time.monotonic_ns()}"
    deadline = time.monotonic() + _STUCK_S * 2
    while store.compare_set(_TOKEN, "", mine).decode() != mine:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the RPC group's token stayed held for {_STUCK_S * 2:g} s: learner {learner} not struck"
            )
        time.sleep(0.01)
    try:
        entries = [e for e in store.get(_WORKERS).decode().split(",") if e]
        base = f"learner{learner}"
        kept = [e for e in entries if e.rpartition("-")[0] != base and not e.startswith(base + "_")]
        store.set(_WORKERS, "".join(f"{e}," for e in kept))
    finally:
        store.set(_TOKEN, "")
        store.set(mine, "Done")  # a process that found the token held waits for this key, as for torch's own


def forget_before_joining(run: RunStore, learner: int) -> None:
    """A new process for lost ``learner`` strikes its earlier ones itself, before it joins: one that died after it
    joined the world but before any server knew of it is still listed, and would be called by this join. Needs
    the run's RPC counters (:func:`~lightning_rudra.transport.rpc_world.set_rpc_counters`): torch keeps the world's
    keys under a prefix per init."""
    forget(learner, dist.PrefixStore(f"rpc_prefix_{rpc._init_counter}", run.store))  # type: ignore[attr-defined]


class TokenWatch:
    """Seen from the server: a process that dies or fails while it joins keeps the group token, and every later
    join would wait for it until its timeout. :meth:`check`, called now and then, frees a token held too long."""

    def __init__(self) -> None:
        self.held: tuple[str, float] = ("", 0.0)

    def check(self) -> Optional[str]:
        """The holder whose token was freed, if one was."""
        store = _agent_store()
        holder = store.get(_TOKEN).decode() if store.check([_TOKEN]) else ""
        now = time.monotonic()
        if not holder:
            self.held = ("", now)
            return None
        if holder != self.held[0]:
            self.held = (holder, now)
            return None
        if now - self.held[1] < _STUCK_S:
            return None
        if store.compare_set(_TOKEN, holder, "").decode() == "":
            store.set(holder, "Done")  # wakes the processes waiting for it, as the holder would have
            self.held = ("", now)
            return holder
        return None
