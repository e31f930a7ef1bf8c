"""A call whose tensors go ahead of it in pieces (:mod:`lightning_rudra.transport.stream`): a push whose gradient is
sent bucket by bucket while the backward pass still makes the rest, then the call itself, which names no gradient.

On the wire a piece is a frame of its own behind the call's number with :data:`PIECE` set; the call's last frame goes
behind the number alone. The server reads the pieces into one flat tensor each (:class:`Assembly`) and hands them to
the call as its gradient; a call that carries a gradient of its own takes that one, and the pieces are dropped (the
learner's gradient changed after a piece went), as they are for :data:`ABANDONED`. After a break, the pieces sent
before it go again on the new connection (RESENT), then the rest as they come.
"""

import threading
from dataclasses import replace
from typing import Any, Optional

import torch
from torch import Tensor
from torch.futures import Future

from lightning_rudra.core.update import Push
from lightning_rudra.transport.frames import TENSORS_LIMIT, DecodeError, Frame, FrameLimits, TensorPiece

PIECE = 1 << 62  # on a call's number: a piece of its tensors follows, not the call
ABANDONED = ("abandoned",)  # the call that ends a call in pieces never finished: the server runs nothing
# pieces in one call, at most: a learner's buckets are fewer (:mod:`lightning_rudra.learner.buckets`)
PIECES_LIMIT = 1 << 16


class PiecedCall:
    """The learner's side: pieces added as they are made (:meth:`add`), then the call (:meth:`finish`); the stream's
    sending thread sends each as it comes. ``changed`` is the stream client's condition (its lock guards this)."""

    def __init__(self, changed: threading.Condition, what: str) -> None:
        self.changed = changed
        self.what = what
        self.future: Future = Future()
        self.pieces: list[Frame] = []
        self.final: Optional[Frame] = None
        self.method = "a call in pieces"
        self.error: Optional[BaseException] = None  # the call could not be sent: its future fails with this
        self.sent = 0  # pieces sent on the current connection (the sending thread's)
        self.final_sent = False

    def add(self, piece: TensorPiece) -> None:
        frame = Frame.encode(piece)  # pickled here: a piece that cannot be sent fails its maker
        with self.changed:
            if self.final is not None:
                raise RuntimeError(f"a piece added to a call to {self.what} already finished")
            self.pieces.append(frame)
            self.changed.notify_all()

    def finish(self, method: str, *args: Any) -> Future:
        """The call itself, once its pieces are all added; its future."""
        try:
            final = Frame.encode((method, *args))
        except Exception as error:
            return self.abandon(RuntimeError(f"{method} cannot be sent to {self.what}: {error}"))
        with self.changed:
            if self.final is not None:
                raise RuntimeError(f"a call in pieces to {self.what} finished twice")
            self.method, self.final = method, final
            self.changed.notify_all()
        return self.future

    def abandon(self, error: BaseException) -> Future:
        """End the call without running it (the gradient was never finished): the server is told so, and the
        future fails with ``error``."""
        with self.changed:
            if self.final is None:  # else finished already: it runs
                self.error = error
                self.final = Frame.encode(ABANDONED)
                self.changed.notify_all()
        return self.future

    def next_frame(self) -> Optional[tuple[Frame, bool]]:
        """(frame, whether it is the call itself) to send next, None while the maker has none (under the lock)."""
        if self.sent < len(self.pieces):
            return self.pieces[self.sent], False
        if self.final is not None and not self.final_sent:
            return self.final, True
        return None

    def resend(self, sock: Any, number: int) -> bool:
        """Send again what went before a break; whether the call went out whole."""
        for frame in self.pieces[: self.sent]:
            frame.send(sock, number | PIECE)
        if self.final_sent:
            assert self.final is not None
            self.final.send(sock, number)
        return self.final_sent


class Assembly:
    """The server's side: a call's pieces read into flat tensors, each allocated at its first piece within the
    stream's ``limits``. A piece that breaks the rules does not end the connection: the call fails, saying why."""

    def __init__(self, limits: FrameLimits) -> None:
        self.limits = limits
        self.tensors: dict[int, Tensor] = {}
        self.spans: dict[int, list[tuple[int, int]]] = {}
        # elements of each tensor its pieces hold: pieces that hold more are refused at once (memory stays bounded),
        # other overlaps and gaps once the call comes (_whole)
        self.covered: dict[int, int] = {}
        self.pieces = 0
        self.allocated = 0
        self.error: Optional[str] = None

    def add(self, piece: Any) -> None:
        if self.error is not None:
            return
        if isinstance(piece, DecodeError):
            self.error = f"a piece could not be decoded: {piece}"
            return
        self.error = self._take(piece)

    def _take(self, piece: Any) -> Optional[str]:
        if not isinstance(piece, TensorPiece):
            return f"a piece is a TensorPiece, not {type(piece).__name__}"
        index, numel, offset, values = piece
        if not all(type(n) is int for n in (index, numel, offset)) or not isinstance(values, Tensor):
            return "a piece names its tensor, size and offset as ints, and carries a tensor"
        if not 0 <= index < TENSORS_LIMIT or numel <= 0 or offset < 0 or values.dim() != 1 or not values.numel():
            return f"piece ({index}, {numel}, {offset}) of {values.numel()} elements is not one of a flat tensor"
        if offset + values.numel() > numel:
            return f"piece of tensor {index} at {offset} of {values.numel()} elements overruns its {numel}"
        self.pieces += 1
        if self.pieces > PIECES_LIMIT:
            return f"more than {PIECES_LIMIT} pieces"
        flat = self.tensors.get(index)
        if flat is None:
            self.allocated += numel * values.element_size()
            if self.allocated > self.limits.tensors:
                return f"its pieces declare more than the stream's {self.limits.tensors} bytes of tensors"
            flat = self.tensors[index] = torch.empty(numel, dtype=values.dtype)
            self.spans[index], self.covered[index] = [], 0
        if flat.numel() != numel or flat.dtype != values.dtype:
            return f"pieces of tensor {index} disagree on its size or dtype"
        self.covered[index] += values.numel()
        if self.covered[index] > numel:
            return f"tensor {index}'s pieces hold more than its {numel} elements: they overlap"
        flat[offset : offset + values.numel()] = values
        self.spans[index].append((offset, offset + values.numel()))
        return None

    def fill(self, call: Any) -> Any:
        """``call`` with its push's gradient made of the pieces (a :class:`DecodeError` for the call to fail with,
        where they do not make one); a push that carries a gradient keeps it."""
        if call == ABANDONED:
            return call
        push = call[-1] if isinstance(call, tuple) and call else None
        if not isinstance(push, Push):
            return DecodeError(f"pieces came ahead of a call that takes no gradient ({self.error or 'all read'})")
        if self.error is None and push.grads is not None:
            return call
        error = self.error or self._whole()
        if error is not None:
            return DecodeError(f"its gradient came in pieces that do not make one: {error}")
        grads = [self.tensors[index] for index in range(len(self.tensors))]
        return (*call[:-1], replace(push, grads=grads))

    def _whole(self) -> Optional[str]:
        if sorted(self.tensors) != list(range(len(self.tensors))):
            return f"its pieces name tensors {sorted(self.tensors)}, not 0 to {len(self.tensors) - 1}"
        for index, spans in self.spans.items():
            end = 0
            for start, stop in sorted(spans):
                if start != end:
                    return f"tensor {index}'s pieces leave a gap or overlap at element {min(start, end)}"
                end = stop
            if end != self.tensors[index].numel():
                return f"tensor {index}'s pieces end at element {end} of {self.tensors[index].numel()}"
        return None
