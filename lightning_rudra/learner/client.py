"""The learner's side of the parameter server: push, pull, the shared epoch's batches and collectives
(:mod:`lightning_rudra.learner.world` starts the servers and joins their RPC world). A call that waits for other
learners waits as long as they are alive (the server's heartbeat watch ends it when one is lost); every other call
has a timeout. Pushes to a server on another host go over a connection of their own
(:mod:`lightning_rudra.transport.stream`). Nothing here knows about Lightning."""

import logging
import re
import threading
from contextlib import contextmanager
from typing import Any, Hashable, Iterator, Optional, Sequence

import torch.distributed.rpc as rpc
from torch import Tensor
from torch.futures import Future

from lightning_rudra.server import process as _server
from lightning_rudra.core.compression import WeightDeltas
from lightning_rudra.core.epoch import EpochPlan
from lightning_rudra.core.errors import ServerLostError, carried
from lightning_rudra.server.membership import this_process
from lightning_rudra.core.registration import Registration
from lightning_rudra.core.update import Push, PushReply
from lightning_rudra.transport.logs import SlowWaits, waits_after
from lightning_rudra.transport.rpc_world import address_towards, server_name
from lightning_rudra.transport.shm import SharedNames
from lightning_rudra.transport.stream import StreamOffer
from lightning_rudra.transport.stream_client import StreamClient
from lightning_rudra.transport.stream_pieces import PiecedCall
from lightning_rudra.core.stats import Stats
from lightning_rudra.core.weights import Snapshot

# torch.distributed.rpc: a timeout of 0 never expires. Calls that wait for other learners use it; the server's
# heartbeat watch fails them instead when a learner is lost.
_NO_TIME_LIMIT = 0
# How TensorPipe words a connection the other side closed or never answered
_CONNECTION_LOST = re.compile(
    r"EOF: end of file|pipe closed|ECONNRESET|ECONNREFUSED|connection reset|Broken pipe|the stream to .* closed", re.I
)
_TIMED_OUT = re.compile(r"ran for more than set timeout|the stream to .* timed out", re.I)

log = logging.getLogger(__name__)


class LearnerClient:
    """One learner's calls to one server process (``server``; the first also answers collectives and deals the
    shared epoch), over RPC: a :class:`~lightning_rudra.learner.server_client.ServerClient`. Holds the timestamp of
    the weights the learner last received from it.

    A thread of its own sends a heartbeat every ``timeout / 4`` seconds (at most 5), with this learner's address
    and process: the server counts a learner silent for longer than ``timeout``, or whose process it sees end, as
    lost, and this learner counts the server as lost when a heartbeat goes unanswered for that long. Either way a
    wait with no time limit ends with an error (or, for a lost learner under ``min_learners``, goes on without it).
    """

    def __init__(
        self, rank: int, timeout: float, server_host: str, server: int = 0, rendezvous: Optional[str] = None
    ) -> None:
        """``server_host``: where the server runs, as far as this learner knows (its heartbeat replies say it
        exactly); ``rendezvous``: where the learners meet (default: ``server_host``)."""
        self.rank = rank
        self.timeout = timeout
        self.server_host = server_host
        self.server = server_name(server)  # its RPC name
        self.index = server
        self.what = "the parameter server" if server == 0 else f"parameter server {server}"
        # named by the server if this learner is lost
        self.address = address_towards(rendezvous or server_host) or "an unknown address"
        self.timestamp = 0
        # the server's weights sent back as bfloat16 differences (compression, see weights_as_deltas); None: whole
        self.deltas: Optional[WeightDeltas] = None
        self.stream: Optional[StreamClient] = None  # pushes over a connection of their own (open_stream)
        self._replies_due = 0  # pushes sent whose reply is not received yet
        self._collectives = 0
        self._interval = min(5.0, timeout / 4)
        self._server_lost: Optional[str] = None
        self._log_waits = waits_after()  # RUDRA_LOG_WAITS, checked before any wait
        self._stop_heartbeat = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name=f"rudra-heartbeat-{rank}", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        process = this_process()
        while True:
            try:
                where = rpc.rpc_sync(
                    self.server,
                    _server.call,
                    timeout=self.timeout,
                    args=("heartbeat", self.rank, self.address, process),
                )
            except Exception as error:
                if not self._stop_heartbeat.is_set():
                    self._server_lost = self._lost(error) or (
                        f"{self.what} (on {self.server_host}) did not answer a heartbeat "
                        f"within {self.timeout:g} s (rpc_timeout): {error}"
                    )
                return
            self.server_host = where or self.server_host
            if self._stop_heartbeat.wait(self._interval):
                return

    def _sync(self, method: str, *args: Any) -> Any:
        with self._naming_a_lost_server():
            return rpc.rpc_sync(self.server, _server.call, args=(method, *args), timeout=self.timeout)

    @contextmanager
    def _naming_a_lost_server(self) -> Iterator[None]:
        """TensorPipe reports a server whose process died as "EOF: end of file", and one it cannot reach as a
        timeout: say what happened, and where."""
        try:
            yield
        except RuntimeError as error:
            lost = self._lost(error)
            if lost is not None:
                raise ServerLostError(lost) from error
            ours = carried(error)  # a LearnerLostError the server raised arrives as a RuntimeError naming it
            if ours is not None:
                raise ours from error
            raise

    def _lost(self, error: Exception) -> Optional[str]:
        """What a failed call says about the server, or None if it says nothing (the heartbeat and every
        call name a lost server the same way)."""
        # a timeout first: its message may quote the error that broke the connection before ("Broken pipe")
        if _TIMED_OUT.search(str(error)):
            return (
                f"{self.what} (on {self.server_host}) did not answer within "
                f"{self.timeout:g} s (rpc_timeout): {error}. Its host may be unreachable, or the "
                "server stopped; its own output may say why."
            )
        if _CONNECTION_LOST.search(str(error)):
            return (
                f"{self.what} (on {self.server_host}) is gone: its connection closed "
                f"({error}). Its process died or was killed; its own output may say why."
            )
        return None

    def _wait(self, what: str, method: str, *args: Any) -> Any:
        future = rpc.rpc_async(self.server, _server.call_async, args=(method, *args), timeout=_NO_TIME_LIMIT)
        return self.result(future, what)

    def result(self, future: Future, what: str = "a reply") -> Any:
        """The value of a call that waits for other learners: no time limit while the server answers. ``what``: what
        it waits for, logged if the wait lasts (``RUDRA_LOG_WAITS``)."""
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        waits = SlowWaits(log, f"learner {int(self.rank)}", self._log_waits)
        waiting: dict[Hashable, tuple[str, str]] = {what: (what, f"{self.what} (on {self.server_host})")}
        waits.check(waiting)
        while not done.wait(min(self._interval, waits.after or self._interval)):
            if self._server_lost is not None:
                raise ServerLostError(self._server_lost)
            waits.check(waiting)
        with self._naming_a_lost_server():
            value = future.wait()
        if isinstance(value, BaseException):  # a wait the server failed (a learner was lost) arrives as a value
            raise value
        return value

    def register(self, registration: Registration) -> None:
        """Learner 0 only: hand the server its part of the model (:meth:`ServerClient.register
        <lightning_rudra.learner.server_client.ServerClient.register>`).

        Args:
            registration: this server's part of the model.
        """
        self._sync("register", registration)

    def attach(self) -> tuple[Optional[SharedNames], Optional[str]]:
        """Once the model is registered: the server's shared memory (None without it) and why it is missing."""
        return self._wait("the model, which learner 0 registers", "attach", self.rank)

    def attached(self, mapped: bool) -> None:
        self._sync("attached", self.rank, mapped)

    def pull(self) -> tuple[list[Tensor], list[Tensor]]:
        params, buffers, self.timestamp = self._wait("the weights", "pull")
        return params, buffers

    def push(self, push: Push, pieces: Optional[PiecedCall] = None) -> Future:
        """Send a gradient (:class:`~lightning_rudra.core.update.Push`); hand the future to :meth:`receive`. Its
        tensors must not change until it resolves (RPC reads them when it sends them).

        Args:
            push: this learner's gradient for this server (``grads=None``: in its shared-memory buffer, or in
                ``pieces``).
            pieces: the call, from :meth:`push_in_pieces`, whose pieces carried the gradient.

        Returns:
            the future of the server's :class:`PushReply`.
        """
        args: tuple = ("push", push)
        if self.deltas is not None:  # the count this learner will have applied when the reply comes
            args = ("push_deltas", self.deltas.compression, self.deltas.count() + self._replies_due, push)
            self._replies_due += 1
        if pieces is not None:
            return pieces.finish(*args)
        if self.stream is not None:
            return self.stream.call(*args)
        return rpc.rpc_async(self.server, _server.call_async, timeout=_NO_TIME_LIMIT, args=args)

    def push_in_pieces(self) -> Optional[PiecedCall]:
        """A push whose gradient goes ahead of it in pieces as the backward pass makes them, over the stream to a
        server that shares no memory with this learner (None elsewhere): finish it with :meth:`push`."""
        return self.stream.call_in_pieces() if self.stream is not None else None

    def open_stream(self) -> None:
        """From now on pushes go over a TCP connection of their own to the server, which moves tensors across a
        link faster than RPC and answers a push's control in half its time (:mod:`lightning_rudra.transport.stream`),
        if the server offers one: it opens it when asked, and hands its secret only through RPC."""
        offer: Optional[StreamOffer] = self._sync("stream_address")
        if offer is None:
            return
        what = f"{self.what} (on {offer.address})"
        try:
            self.stream = StreamClient(offer, self.timeout, what)
            self.stream.timeline_numbers = (self.rank, self.index)
        except OSError as error:
            raise RuntimeError(
                f"learner {self.rank} could not connect to {what} at port {offer.port} for its pushes: {error}. A "
                "firewall between the hosts must let the servers' ports through, as RPC's."
            ) from error

    def weights_as_deltas(self, compression: str) -> None:
        """From now on the weights that come back with a push over the stream (:meth:`open_stream`) travel as
        differences from those this learner holds, in the wire dtype of ``compression``
        (:class:`~lightning_rudra.core.compression.WeightDeltas`). The stream answers in order, so the server knows
        which weights the learner will hold; through RPC, replies may be made in another order: whole there."""
        if self.stream is not None:
            self.deltas = WeightDeltas(compression)

    def receive(self, pushed: Future) -> PushReply:
        """The server's reply to a push; its clock is the timestamp of this learner's next push."""
        reply: PushReply = self.result(pushed, "the reply to its push")
        self.timestamp = reply.clock
        if self.deltas is not None:
            self._replies_due -= 1
            reply = reply._replace(params=self.deltas.decode(reply.params))  # type: ignore[arg-type]
        return reply

    def finish(self) -> Future:
        """Stop pushing; hand the future to :meth:`final_weights`."""
        return rpc.rpc_async(self.server, _server.call_async, args=("finish", self.rank), timeout=_NO_TIME_LIMIT)

    def final_weights(self, finished: Future) -> tuple[Optional[list[Tensor]], Optional[list[Tensor]]]:
        """Once every learner has stopped: the final weights (None: in shared memory)."""
        params, buffers, self.timestamp = self.result(finished, "the end of training, once every learner finished")
        return params, buffers

    def gather(self, obj: Any) -> dict[int, Any]:
        """Every learner's ``obj`` (learner -> obj, in rank order), but those of learners lost under
        ``min_learners``. All learners must call collectives in the same order."""
        self._collectives += 1
        return self._wait(
            f"collective {self._collectives}, which every learner reaches", "gather", self._collectives, self.rank, obj
        )

    def draw(  # 6 params: EpochPool.draw's request
        self,
        pool: int,
        epoch: int,
        plan: EpochPlan,
        want: int,
        trained: Optional[int] = None,
        late: Sequence[int] = (),
    ) -> Future:
        """Ask for up to ``want`` next batches of the shared epoch of train dataloader ``pool``, saying that this
        learner has trained on ``trained`` of the batches dealt to it and that the gradients of its batches ``late``
        came late; its :meth:`result` is ``EpochPool.draw``'s."""
        args = ("draw", pool, epoch, self.rank, plan, want, trained, tuple(late))
        return rpc.rpc_async(self.server, _server.call, args=args, timeout=self.timeout)

    def stop_drawing(self) -> None:
        """This learner stops training: no learner gets another batch of the shared epoch."""
        self._sync("stop_drawing", self.rank)

    def rejoin(self, module: dict[str, Any]) -> Future:
        """This process takes a lost learner's place: hand the future to :meth:`result`, which gives the
        ``Admission`` and the optimizers' hyper-parameters once the server admits it (at an epoch's start), or None
        if training ended first. ``module``: :func:`~lightning_rudra.server.rejoins.describe_module`."""
        return rpc.rpc_async(
            self.server, _server.call_async, args=("rejoin", self.rank, module), timeout=_NO_TIME_LIMIT
        )

    def progress(self, epoch: int, global_step: int) -> None:
        """This learner starts ``epoch`` at ``global_step`` (elastic runs: where a rejoining learner starts)."""
        self._sync("progress", self.rank, epoch, global_step, self._collectives)

    def continue_collectives(self, count: int) -> None:
        """A rejoined learner's next collective is the others' ``count + 1``-th."""
        self._collectives = count

    def leave(self, error: Optional[str] = None) -> None:
        """Leave this stage (``error``: why this learner stopped training early, for the others to hear)."""
        self._stop_heartbeat.set()
        self._heartbeat.join()
        if self.stream is not None:
            self.stream.close()
        if self._server_lost is None:  # a server that stopped answering would only make this call wait it out
            self._sync("leave", self.rank, error)

    def report(self, learner: int, why: str, process: tuple[str, int]) -> None:
        """This learner's launcher saw ``learner``'s ``process`` (machine, pid) end: the server need not wait for its
        silence."""
        self._sync("report", self.rank, learner, why, process)

    def stats(self) -> Stats:
        return Stats.from_dict(self._sync("stats"))

    def snapshot(self) -> Snapshot:
        """Weights, buffers (flat), clock, optimizer states and statistics, all of one clock: the learner loads these
        weights (its next push's timestamp)."""
        snapshot: Snapshot = self._sync("snapshot")
        self.timestamp = snapshot.clock
        return snapshot

    def optimizer_state(self, optimizer: int) -> dict[str, Any]:
        return self._sync("optimizer_state", optimizer)

    def load_optimizer_state(self, optimizer: int, state: dict[str, Any]) -> None:
        self._sync("load_optimizer_state", optimizer, state)
