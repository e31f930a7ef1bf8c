"""Pushes during the backward pass (:class:`Bucketing`): a learner's gradient for a server on another host goes in
buckets of about ``bucket_cap_mb`` as the backward pass finishes them, as DDP's all-reduce does, so that the link
carries the first buckets while the last ones are computed.

A bucket is a run of the parameters (the parts of them the server owns) in the reverse of the module's order, the
order the backward pass usually finishes them in. It goes once every parameter in it has its gradient of this step
(``register_post_accumulate_grad_hook``), packed as the push would pack it (in the wire dtype with ``compression``),
through the push stream as a piece of the push (:mod:`lightning_rudra.transport.stream_pieces`). At the step, the
buckets not sent yet (parameters without a gradient) go, then the push itself, without its gradient. The gradient is
still one gradient: the push's timestamp, finiteness and clipping are decided at the step, from the whole of it.

What is sent early is checked at the step: a gradient changed after its bucket went (a second backward pass, a change
made in ``on_before_optimizer_step``) makes the push carry the whole gradient, which the server takes instead of
the pieces. Only the step's own backward pass sends buckets (``LearnerOptimizer.step`` runs it): the micro-batches an
accumulation window adds before it do not.
"""

import threading
import warnings
from typing import Hashable, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from lightning_rudra.core.compression import ErrorFeedback
from lightning_rudra.core.shards import piece_view
from lightning_rudra.learner.client import LearnerClient
from lightning_rudra.learner.link import ServerLink
from lightning_rudra.transport.frames import TensorPiece
from lightning_rudra.transport.stream_pieces import PIECES_LIMIT, PiecedCall


class Bucket(NamedTuple):
    """Elements ``start:stop`` of flat tensor ``tensor`` of a link's gradient layout: its ``parts`` (indices into
    the layout's tensors)."""

    tensor: int
    start: int
    stop: int
    parts: tuple[int, ...]


class LinkBuckets(NamedTuple):
    """One link's buckets for one optimizer, where each part of its layout lies, and each part's bucket."""

    link: ServerLink
    buckets: list[Bucket]
    spans: list[tuple[int, int]]  # per part of the layout: its elements in its flat tensor
    bucket_of: dict[int, int]  # parameter position -> the bucket holding its part


def lay_out_buckets(link: ServerLink, index: int, cap_bytes: int) -> Optional[LinkBuckets]:
    """The buckets of optimizer ``index``'s gradient part that ``link``'s server owns: from the layout's end, each
    closed once it holds ``cap_bytes`` (no more than the stream takes in one call: larger if need be). None where a
    dtype's flat tensor is empty (its push goes whole, as without buckets)."""
    layout = link.grad_layouts[index]
    if not all(layout.numels.values()):
        return None
    total = sum(numel * dtype.itemsize for dtype, numel in layout.numels.items())
    cap_bytes = max(cap_bytes, -(-total // (PIECES_LIMIT - len(layout.numels))))
    buckets: list[Bucket] = []
    spans = [(0, 0)] * len(layout)
    for tensor, (dtype, part_indices) in enumerate(layout.groups.items()):
        offset = 0
        for i in part_indices:
            spans[i] = (offset, offset + layout.shapes[i].numel())
            offset = spans[i][1]
        held: list[int] = []
        for i in reversed(part_indices):
            held.append(i)
            start, stop = spans[i][0], spans[held[0]][1]
            if (stop - start) * dtype.itemsize >= cap_bytes or start == 0:
                if stop > start:  # parameters of no elements alone: nothing to send
                    buckets.append(Bucket(tensor, start, stop, tuple(held)))
                held = []
    bucket_of = {link.owned[index][i][0]: b for b, bucket in enumerate(buckets) for i in bucket.parts}
    return LinkBuckets(link, buckets, spans, bucket_of)


def bucketed(link: ServerLink) -> bool:
    """Whether ``link`` carries its gradient in pieces: over the push stream, without shared memory (another
    host's server) or a node's aggregation."""
    return (
        isinstance(link.client, LearnerClient)
        and link.client.stream is not None
        and link.shm is None
        and (link.node is None)
    )


class _Open:
    """One link's push of this step in pieces: its flat gradient, its buckets sent, what each still waits for."""

    def __init__(self, laid: LinkBuckets) -> None:
        self.laid = laid
        self.call: Optional[PiecedCall] = None
        self.flats: Optional[list[Tensor]] = None
        # error feedback's rounding errors of the buckets sent, as they were before: restored if the pieces are
        # dropped (the push carries the gradient whole, or the step fails), whose errors the server never saw
        self.residuals_before: dict[Hashable, Optional[list[Optional[Tensor]]]] = {}
        self.waiting = [len(bucket.parts) for bucket in laid.buckets]
        self.sent = [False] * len(laid.buckets)


class Bucketing:
    """A learner's pushes in buckets (``cap_mb`` MiB each), per step of one optimizer: :meth:`begin` before its
    backward pass, :meth:`ready` from each parameter's hook, :meth:`end` at its push, per link."""

    def __init__(self, cap_mb: float, feedback: Optional[ErrorFeedback]) -> None:
        self.cap_mb = cap_mb
        self.cap_bytes = int(cap_mb * 2**20)
        self.feedback = feedback
        # (server, optimizer): the link laid out at its first step, and its buckets (None: pushed whole)
        self._laid: dict[tuple[int, int], tuple[ServerLink, Optional[LinkBuckets]]] = {}
        self._open: dict[int, _Open] = {}  # server -> this step's push in pieces
        self._index: Optional[int] = None  # the optimizer whose step's backward pass runs
        self._params: Sequence[Tensor] = ()
        self._ready: set[int] = set()  # positions among its parameters whose gradient is final
        self._changed = False  # a gradient changed after its bucket went: the push carries it whole
        self._lock = threading.Lock()  # hooks may run on several autograd threads (a model over several devices)
        self._told = False  # whether learner 0 said that no link takes buckets
        self.pieces = 0  # buckets sent, all steps together
        self.pushes = {"in pieces": 0, "whole": 0}  # pushes that ended calls in pieces, by what held the gradient

    def begin(self, index: int, params: Sequence[Tensor], links: Sequence[ServerLink]) -> None:
        """The step of optimizer ``index`` (of ``params``) runs its backward pass."""
        self.abandon(RuntimeError("a new step began before the push of the last"))
        self._index, self._params, self._ready, self._changed = index, params, set(), False
        if not self._told:
            self._told = True
            self._tell_if_unused(links)
        for link in links:
            if bucketed(link) and link.owned[index]:
                key = (link.server, index)
                if key not in self._laid or self._laid[key][0] is not link:  # a new link: the cuts moved
                    self._laid[key] = (link, lay_out_buckets(link, index, self.cap_bytes))
                laid = self._laid[key][1]
                if laid is not None:
                    self._open[link.server] = _Open(laid)

    def _tell_if_unused(self, links: Sequence[ServerLink]) -> None:
        """Learner 0 warns, once, where no server takes its gradient in buckets (on one host, the option then changes
        nothing, which its user would otherwise not see). It says what it knows: its own pushes (a learner on another
        host may still send buckets to a server on this one)."""
        if links and links[0].client.rank == 0 and not any(map(bucketed, links)):
            warnings.warn(
                f"lightning_rudra: bucket_cap_mb={self.cap_mb:g} changes nothing for learner 0's pushes: every "
                "server it pushes to shares memory with it, and buckets go only to a server on another host, over "
                "the push stream (not with shared_memory=False, nor a node's aggregated push); its gradient goes "
                "after the backward pass. Learners on another host than their servers' still send buckets."
            )

    def ready(self, index: int, position: int) -> None:
        """The gradient of parameter ``position`` of optimizer ``index`` is final for this backward pass."""
        with self._lock:
            if index != self._index:
                return
            if position in self._ready:  # a second backward pass adds to it
                self._changed = True
            self._ready.add(position)
            if self._changed:
                return
            for open_ in self._open.values():
                bucket = open_.laid.bucket_of.get(position)
                if bucket is not None:
                    open_.waiting[bucket] -= 1
                    if not open_.waiting[bucket]:
                        self._send(open_, bucket)

    def forget(self, index: int) -> None:
        """The gradient of optimizer ``index`` was zeroed: pieces sent of it no longer hold it."""
        if index == self._index and any(any(open_.sent) for open_ in self._open.values()):
            self._changed = True

    def end(self, link: ServerLink, index: int) -> Optional[tuple[PiecedCall, bool]]:
        """At the push to ``link``: its call in pieces, if one began, and whether they hold the whole gradient (its
        last buckets sent now); if not, the push must carry it. The call stays this step's until :meth:`pushed`
        (a push that fails first abandons it)."""
        open_ = self._open.get(link.server) if index == self._index else None
        if open_ is None or open_.call is None:
            return None
        if self._changed or not self._unchanged(open_):
            self._drop_residuals(open_)
            self.pushes["whole"] += 1
            return open_.call, False
        for bucket, sent in enumerate(open_.sent):
            if not sent:
                self._send(open_, bucket)
        self.pushes["in pieces"] += 1
        return open_.call, True

    def pushed(self, link: ServerLink) -> None:
        """The push to ``link`` ended its call in pieces (or abandoned it: its push could not be sent)."""
        open_ = self._open.pop(link.server, None)
        if open_ is not None and open_.call is not None and open_.call.error is not None:
            self._drop_residuals(open_)

    def abandon(self, error: BaseException) -> None:
        """End every call in pieces not pushed (the step failed): the servers run none of them."""
        for open_ in self._open.values():
            if open_.call is not None:
                self._drop_residuals(open_)
                open_.call.abandon(error)
        self._open.clear()
        self._index = None

    def _drop_residuals(self, open_: _Open) -> None:
        """The pieces of ``open_`` will not be applied: error feedback forgets the rounding errors they left."""
        if self.feedback is not None:
            for key, before in open_.residuals_before.items():
                if before is None:
                    self.feedback.residuals.pop(key, None)
                else:
                    self.feedback.residuals[key] = before
            open_.residuals_before.clear()

    def _grad_part(self, laid: LinkBuckets, index: int, part: int) -> Optional[Tensor]:
        """Part ``part`` of the link's layout, from its parameter's gradient now (None: it has none)."""
        position, piece = laid.link.owned[index][part]
        grad = self._params[position].grad
        if grad is None:
            return None
        return piece_view(grad.to_dense() if grad.is_sparse else grad, piece)

    def _send(self, open_: _Open, b: int) -> None:
        laid, index = open_.laid, self._index
        assert index is not None
        link, bucket = laid.link, laid.buckets[b]
        layout = link.grad_layouts[index]
        if open_.flats is None:
            open_.flats = [torch.empty(numel, dtype=dtype) for dtype, numel in layout.numels.items()]
        flat = open_.flats[bucket.tensor]
        for part in bucket.parts:
            start, stop = laid.spans[part]
            grad = self._grad_part(laid, index, part)
            if grad is None:
                flat[start:stop].zero_()
            else:
                flat[start:stop].copy_(grad.reshape(-1))
        values = flat[bucket.start : bucket.stop]
        if self.feedback is not None:  # each bucket keeps its own rounding error
            key = (link.server, index, link.client.rank, bucket.tensor, bucket.start)
            kept = self.feedback.residuals.get(key)
            open_.residuals_before[key] = None if kept is None else list(kept)
            values = self.feedback.compress(key, [values.clone()])[0]
        if open_.call is None:
            assert isinstance(link.client, LearnerClient)
            open_.call = link.client.push_in_pieces()
            assert open_.call is not None
        open_.call.add(TensorPiece(bucket.tensor, flat.numel(), bucket.start, values))
        open_.sent[b] = True
        self.pieces += 1

    def _unchanged(self, open_: _Open) -> bool:
        """Whether the gradient still holds what the buckets sent of it."""
        laid, index = open_.laid, self._index
        assert index is not None and open_.flats is not None
        for b, bucket in enumerate(laid.buckets):
            if not open_.sent[b]:
                continue
            for part in bucket.parts:
                start, stop = laid.spans[part]
                grad = self._grad_part(laid, index, part)
                sent = open_.flats[bucket.tensor][start:stop]
                if grad is None or not torch.equal(grad.reshape(-1).to(sent.device), sent):
                    return False
        return True
