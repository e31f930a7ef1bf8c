"""The tensor stream's frames (:mod:`lightning_rudra.transport.stream`): a header (the pickled part's length, the
tensors' total bytes), the call pickled with each tensor left out, then the tensors' bytes in order.

A frame comes from a peer that proved it belongs to the run, and is still decoded as if it did not: both lengths are
checked against :class:`FrameLimits` before anything is allocated, and the pickled part may only name what the wire
carries (:data:`CARRIED`: tensors, numbers, strings, containers, torch dtypes and the project's own messages); any
other global is refused before it is imported. A frame that cannot be decoded is still read whole, so that the
connection stays in step and the receiver can say why.
"""

import io
import math
import pickle
import socket
import struct
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from lightning_rudra.core.clipping import Clipping
from lightning_rudra.core.compression import WeightMessage
from lightning_rudra.core.update import Push, PushReply
from lightning_rudra.transport.elastic import LearnerId

_HEADER = struct.Struct("!QQ")  # the pickled part's length, the tensors' total bytes
_NUMBER = struct.Struct("!Q")  # a call's number ahead of its frame: known even when the frame cannot be decoded
_KEEPALIVE = _HEADER.pack(0, 0)  # a frame of nothing: "still working on your call" (no frame pickles to 0 bytes)
_PICKLED_LIMIT = 1 << 20  # a push's pickled part is its hyper-parameters and numbers: kilobytes
_TENSOR_SLACK = 1 << 20  # beyond twice the model: a push's has_grad flags, a reply's clock
_CHUNK = 1 << 20  # sends go in pieces, so that a timeout bounds the time without progress, not a whole push
# a push or a reply holds a flat tensor per dtype of the weights, gradient and buffers: a handful, never thousands
# (each is an allocation, however small: a 1 MiB pickle could otherwise name 50,000 empty tensors)
TENSORS_LIMIT = 1024


class TensorPiece(NamedTuple):
    """Elements ``offset:offset + len(values)`` of flat tensor ``tensor`` (of ``numel`` elements) of a call sent in
    pieces (:mod:`lightning_rudra.transport.stream_pieces`)."""

    tensor: int
    numel: int
    offset: int
    values: Tensor


# The globals a frame may name, beside torch's dtypes: what a push and its reply are made of
CARRIED: dict[tuple[str, str], Any] = {
    (cls.__module__, cls.__qualname__): cls
    for cls in (Clipping, LearnerId, Push, PushReply, TensorPiece, WeightMessage, complex)
}


class FrameLimits(NamedTuple):
    """The largest frame a stream accepts: bytes of the pickled part, and of the tensors beside it."""

    pickled: int
    tensors: int

    @classmethod
    def for_model(cls, model_bytes: int) -> "FrameLimits":
        """For the calls of a run whose weights and buffers (as the server holds them) take ``model_bytes``: a push
        carries a gradient and the buffers, a reply the weights and the buffers."""
        return cls(_PICKLED_LIMIT, 2 * model_bytes + _TENSOR_SLACK)


KEEPALIVE = object()  # what :func:`recv_frame` gives for a keepalive frame


class FrameError(ConnectionError):
    """A frame that breaks the protocol (over the limits): the connection cannot go on."""


class DecodeError(Exception):
    """A frame, read whole, whose content could not be decoded (a global not carried, memory that could not be
    allocated): the connection is still in step."""


class Frame(NamedTuple):
    """A call pickled, ready to send: pickling fails here, before any byte is sent."""

    head: bytes  # header and pickled part
    tensors: list[Tensor]

    @classmethod
    def encode(cls, obj: Any) -> "Frame":
        file = io.BytesIO()
        pickler = _Pickler(file)
        pickler.dump(obj)
        pickled = file.getvalue()
        total = sum(t.numel() * t.element_size() for t in pickler.tensors)
        for tensor in pickler.tensors:  # a tensor whose bytes cannot be read (a conjugate view) fails here, unsent
            _bytes(tensor)
        return cls(_HEADER.pack(len(pickled), total) + pickled, pickler.tensors)

    def size(self) -> int:
        """Its bytes on the wire."""
        return len(self.head) + sum(t.numel() * t.element_size() for t in self.tensors)

    def over(self, limits: FrameLimits) -> Optional[str]:
        """Why the receiver would refuse this frame as over ``limits`` (None: it would not)."""
        pickled = len(self.head) - _HEADER.size
        total = sum(t.numel() * t.element_size() for t in self.tensors)
        if pickled > limits.pickled or total > limits.tensors:
            return (
                f"{pickled} pickled bytes and {total} bytes of tensors, over the stream's {limits.pickled} and "
                f"{limits.tensors} (twice the model)"
            )
        if len(self.tensors) > TENSORS_LIMIT:
            return f"{len(self.tensors)} tensors, over the stream's {TENSORS_LIMIT}"
        return None

    def send(self, sock: socket.socket, number: Optional[int] = None) -> None:
        """Send, behind the call's ``number`` if it is one."""
        if number is not None:
            sock.sendall(_NUMBER.pack(number))
        _send(sock, memoryview(self.head))
        for tensor in self.tensors:
            if tensor.numel():
                _send(sock, _bytes(tensor))


def send_frame(sock: socket.socket, obj: Any) -> None:
    Frame.encode(obj).send(sock)


def send_keepalive(sock: socket.socket) -> None:
    sock.sendall(_KEEPALIVE)


def recv_number(sock: socket.socket) -> int:
    """The number of the next call (a learner may take its time between two calls)."""
    return _NUMBER.unpack(_read(sock, memoryview(bytearray(_NUMBER.size)), patient=True))[0]


def recv_frame(sock: socket.socket, limits: FrameLimits, patient: bool = False) -> Any:
    """The next object sent with :func:`send_frame` (:data:`KEEPALIVE` for a keepalive). ``patient``: a socket
    timeout before the frame's first byte is not an error (a learner between two pushes); within a frame it is.
    Raises ConnectionError when the other side closed, :class:`FrameError` for a frame over ``limits`` and
    :class:`DecodeError` (the frame consumed) for one that cannot be decoded."""
    header = _read(sock, memoryview(bytearray(_HEADER.size)), patient)
    length, total = _HEADER.unpack(header)
    if (length, total) == (0, 0):
        return KEEPALIVE
    if not 0 < length <= limits.pickled or total > limits.tensors:
        raise FrameError(
            f"a frame of {length} pickled bytes and {total} bytes of tensors is not one of this run's stream: "
            f"at most {limits.pickled} and {limits.tensors} (twice the model)"
        )
    try:
        pickled = _read(sock, memoryview(bytearray(length)))
    except MemoryError as error:
        _drain(sock, length + total)
        raise DecodeError(f"{type(error).__name__}: {error}") from error
    try:
        unpickler = _Unpickler(pickled, total)
        obj = unpickler.load()
        if unpickler.left:
            raise pickle.UnpicklingError(f"its header declares {total} bytes of tensors, its tensors hold fewer")
    except Exception as error:  # a refused global, MemoryError, a malformed pickle: all of it still comes
        _drain(sock, total)
        raise DecodeError(f"{type(error).__name__}: {error}") from error
    for tensor in unpickler.tensors:
        if tensor.numel():
            _read(sock, _bytes(tensor))
    return obj


class _Pickler(pickle.Pickler):
    """Pickles a call, leaving its tensors out: each becomes a reference to its dtype and shape."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[Tensor] = []

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, Tensor):
            self.tensors.append(obj.detach().cpu().contiguous())
            return (obj.dtype, tuple(obj.shape))
        return None


class _Unpickler(pickle.Unpickler):
    """Unpickles a call with only :data:`CARRIED` globals, allocating each tensor left out (within the ``total``
    bytes the header declared), for its bytes to be read into."""

    def __init__(self, pickled: memoryview, total: int) -> None:
        super().__init__(io.BytesIO(pickled))
        self.tensors: list[Tensor] = []
        self.left = total

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in CARRIED:
            return CARRIED[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"{module}.{name} is not carried by the stream, which takes tensors, numbers, strings, lists, tuples, "
            f"dicts, torch dtypes and {', '.join(sorted(name for _, name in CARRIED))}"
        )

    def persistent_load(self, pid: Any) -> Tensor:
        if not (
            isinstance(pid, tuple)
            and len(pid) == 2
            and isinstance(pid[0], torch.dtype)
            and isinstance(pid[1], tuple)
            and all(type(n) is int and n >= 0 for n in pid[1])
        ):
            raise pickle.UnpicklingError(f"a tensor is referred to as (dtype, shape), not {pid!r:.100}")
        if len(self.tensors) == TENSORS_LIMIT:
            raise pickle.UnpicklingError(f"it holds more than {TENSORS_LIMIT} tensors, which no push or reply does")
        dtype, shape = pid
        size = math.prod(shape) * dtype.itemsize
        if size > self.left:
            raise pickle.UnpicklingError(f"its tensors hold more bytes than its header declares ({size} > {self.left})")
        self.left -= size
        tensor = torch.empty(shape, dtype=dtype)
        self.tensors.append(tensor)
        return tensor


def _bytes(tensor: Tensor) -> memoryview:
    """The tensor's memory as bytes, shared (a received tensor is read into it in place)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def _send(sock: socket.socket, data: memoryview) -> None:
    for start in range(0, len(data), _CHUNK):
        sock.sendall(data[start : start + _CHUNK])


def _read(sock: socket.socket, into: memoryview, patient: bool = False) -> memoryview:
    got = 0
    while got < len(into):
        try:
            count = sock.recv_into(into[got:])
        except socket.timeout:
            if patient and got == 0:
                continue
            raise
        if count == 0:
            raise ConnectionError("the connection closed (end of file)")
        got += count
    return into


def _drain(sock: socket.socket, count: int) -> None:
    """Read and drop ``count`` bytes (a frame that could not be decoded), a piece at a time."""
    scratch = memoryview(bytearray(min(count, _CHUNK) or 1))
    while count:
        count -= len(_read(sock, scratch[: min(count, len(scratch))]))
