"""What one learner exchanges with one server process (:class:`ServerLink`): its part of the module's weights and
gradients, and how they travel: shared memory (:mod:`lightning_rudra.transport.shm`) on that server's host, the push
stream (:mod:`lightning_rudra.transport.stream`) to another host, RPC with ``shared_memory=False``. The push stream
carries the pushes on the server's host too, with the tensors left in shared memory: a socket's round trip costs
about half of RPC's (TensorPipe), which a small model's step feels.
:class:`~lightning_rudra.learner.learner.Learner` pushes through one link per server."""

import socket
import warnings
from typing import Callable, Optional

import torch
from torch import Tensor

from lightning_rudra.core.flat import FlatLayout
from lightning_rudra.core.shards import Piece, parts
from lightning_rudra.learner.client import LearnerClient
from lightning_rudra.learner.node import NodeMember
from lightning_rudra.learner.server_client import ServerClient
from lightning_rudra.transport.shm import MappedWeights

_CPU = torch.device("cpu")


class ServerLink:
    """What one learner exchanges with one server process: its part of the module's weights and gradients
    (:class:`~lightning_rudra.core.shards.ShardPlan`), and how they travel (shared memory on that server's host, the
    push stream for every push, RPC with ``shared_memory=False``)."""

    def __init__(self, server: int, client: ServerClient, params: list[Tensor], buffers: list[Tensor]) -> None:
        self.server = server
        self.client = client
        self.params = params  # the module's parameters, or flat views of the slices its server owns
        self.buffers = buffers
        self.param_layout = FlatLayout(params)
        self.buffer_layout = FlatLayout(buffers)
        self.grad_layouts: list[FlatLayout] = []  # per optimizer, of the part of its parameters its server owns
        # per optimizer: (position among its parameters, piece) of those its server owns (ShardPlan.owned)
        self.owned: list[list[tuple[int, Piece]]] = []
        self.shm: Optional[MappedWeights] = None
        self.attached = False
        # this learner's part in its node's pushes to a server on another host (node-local aggregation)
        self.node: Optional[NodeMember] = None

    def lay_out(self, owned: list[list[tuple[int, Piece]]], optimizer_params: list[list[Tensor]]) -> None:
        """Which part of every optimizer's parameters (``optimizer_params``, in its groups' order) this server owns:
        ``owned`` per optimizer (:meth:`ShardPlan.owned <lightning_rudra.core.shards.ShardPlan.owned>`), and the layout
        of the gradient part it is pushed."""
        self.owned = owned
        self.grad_layouts = [
            FlatLayout(parts([p.detach() for p in params], pieces)) for params, pieces in zip(optimizer_params, owned)
        ]

    def attach(self, shared_memory: bool, compression: Optional[str] = None) -> None:
        """Map the server's shared memory if it has some and runs on this host; tell it either way. ``compression``:
        a server reached through RPC sends its weights back as differences in that wire dtype."""
        self.attached = True
        if shared_memory:
            self._map()
        else:
            self.client.attached(False)
        if shared_memory and isinstance(self.client, LearnerClient):
            self._open_stream()
        if compression is not None and self.shm is None:
            self.client.weights_as_deltas(compression)

    def _open_stream(self) -> None:
        """Push over a connection of this learner's own: to another host's server, tensors cross the link faster than
        through RPC; to this host's, only the push's control goes, in about half RPC's time. To this host's server
        it is only faster: if it cannot be opened (its handshake slots kept taken), the pushes go through RPC."""
        assert isinstance(self.client, LearnerClient)
        try:
            self.client.open_stream()
        except RuntimeError as error:
            if self.shm is None:
                raise
            warnings.warn(
                f"lightning_rudra: learner {self.client.rank} could not open its push stream to {self.client.what} on "
                f"its own host ({error.__cause__ or error}). Its pushes go through RPC instead (slower for a small "
                "model)."
            )

    def _map(self) -> None:
        client = self.client
        if not isinstance(client, LearnerClient):
            raise TypeError(
                f"shared_memory=True maps a server process's shared memory, which a {type(client).__name__} has "
                "none of: pass shared_memory=False."
            )
        names, error = client.attach()
        if error is not None and client.rank == 0:
            warnings.warn(f"lightning_rudra: {error} Weights and gradients go through RPC instead (slower).")
        if names is not None and names.host == socket.gethostname():
            try:
                self.shm = MappedWeights(
                    names,
                    client.rank,
                    f"{client.what} (on {client.server_host})",
                    client.timeout,
                    lambda: client._server_lost,
                    lambda: (*client.pull(), client.timestamp),  # under the server's lock, for a reader overtaken
                )
            except OSError as why:  # the same host name, but not the same /dev/shm
                warnings.warn(
                    f"lightning_rudra: learner {client.rank} could not map the shared memory of "
                    f"{client.what}, though both run on a host named {names.host}: {why}. Another "
                    "container or machine of that name? Weights and gradients go through RPC instead "
                    "(slower)."
                )
        self.client.attached(self.shm is not None)

    def load_reply(
        self,
        flat_params: Optional[list[Tensor]],
        flat_buffers: Optional[list[Tensor]],
        sent: Optional[list[Tensor]] = None,
    ) -> None:
        """Load a reply's weights (None: read them from shared memory). ``sent``: the buffers pushed for this
        reply, under overlap: the reply's buffers predate the forward passes run since, whose changes (BatchNorm
        statistics) stay on top of them."""
        load: Callable[[list[Tensor], list[Tensor]], None] = self.load
        if sent is not None and self.buffers:
            now = self.buffer_layout.pack(self.buffers, _CPU)

            def load(params: list[Tensor], buffers: list[Tensor]) -> None:
                self.load(params, [_rebased(*b) for b in zip(buffers, now, sent)])

        if flat_params is None:
            assert self.shm is not None
            self.client.timestamp = self.shm.read(load)
        else:
            load(flat_params, flat_buffers or [])

    @torch.no_grad()
    def load(self, flat_params: list[Tensor], flat_buffers: list[Tensor]) -> None:
        for layout, flats, targets in (
            (self.param_layout, flat_params, self.params),
            (self.buffer_layout, flat_buffers, self.buffers),
        ):
            if targets:
                device = targets[0].device
                torch._foreach_copy_(targets, layout.unpack([f.to(device, non_blocking=True) for f in flats]))


def _rebased(replied: Tensor, now: Tensor, sent: Tensor) -> Tensor:
    """A reply's buffer plus what the module changed in it since it sent ``sent``; a flag (bool) has no
    difference to carry: the module's own, newer, value."""
    return now if now.dtype == torch.bool else replied + (now - sent)
