"""Shared memory between the server and the learners on its host: no bytes of weights or gradients through RPC.

The server keeps its master weights and buffers (flat, one buffer per dtype) in files under ``/dev/shm``, and
one gradient buffer per learner and optimizer. A learner on the same host maps them: a push is a copy of its
gradient into its buffer plus an RPC that carries only control (learner, optimizer, timestamp, learning
rates); a pull is one copy out of the server's weights. RPC pickles nothing large, and the server clones
nothing for a reply.

A pull must see one update's weights, not parts of two, without taking the server's lock for the copy: a
sequence lock. The server makes the version odd while it changes the weights and even again after, with the
new clock; a reader copies, then checks that the version was even and did not move, and copies again if it did.
A reader is told the server died only when one update stays unfinished for ``rpc_timeout``; a reader that updates
keep overtaking (its copy slower than the gap between two of them) takes the weights through RPC, under the
server's lock, after a few tries.
The lock has no memory fences: it relies on x86's store and load order, so other CPUs use RPC
(:func:`shared_memory_refused`).

A learner uses the files only once it has proved that it maps the server's own: the header holds a random token
that the server also sends over RPC. A learner with the server's host name but another /dev/shm (a container on
the host's network, two machines of one name) finds no files, or other ones, and uses RPC.
"""

import mmap
import os
import platform
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from lightning_rudra.core.flat import FlatLayout, WeightsStore
from lightning_rudra.core.errors import ServerLostError

SHM_DIR = "/dev/shm"

Files = list[tuple[str, int, torch.dtype]]  # one (path, numel, dtype) per flat buffer

_X86 = ("x86_64", "AMD64", "i386", "i686")
# updates begun during one read before it takes the weights under the server's lock instead: a copy slower than
# the gap between updates (a big model, a busy server) would otherwise never see one whole, and a reader that finds
# back-to-back updates in progress at every look would wait for a gap that may not come
_OVERTAKEN = 4


def shared_memory_refused(machine: str) -> Optional[str]:
    """Why shared memory is not used on a CPU of this ``platform.machine()``, or None. The sequence lock's plain
    stores and loads are seen in program order only under x86's total store order; a weakly ordered CPU
    (aarch64, POWER) may show a reader new weights with an old version."""
    if machine in _X86:
        return None
    return (
        f"shared memory is not used on this {machine or 'unknown'} CPU: its sequence lock is only correct on "
        "x86 (no memory fences)."
    )


def _create(path: str, numel: int, dtype: torch.dtype) -> Tensor:
    """A new file of ``numel`` x ``dtype`` at ``path``, its space reserved, mapped. Files in tmpfs are sparse: a
    page is only claimed when first written, and one that cannot be is a SIGBUS, so claim them all now."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, numel * dtype.itemsize)
        return _map(fd, numel, dtype)
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def _open(path: str, numel: int, dtype: torch.dtype) -> Tensor:
    """The existing file at ``path``, mapped; never created (``torch.from_file`` would: a learner in another
    /dev/shm would then train on zeros)."""
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size < numel * dtype.itemsize:
            raise OSError(f"{path} holds {size} bytes, not the {numel} x {dtype} the server made")
        return _map(fd, numel, dtype)
    finally:
        os.close(fd)


def remove(paths: Sequence[str]) -> list[str]:
    """Remove the files (mappings of them stay valid); returns the paths left: none."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return []


def _map(fd: int, numel: int, dtype: torch.dtype) -> Tensor:
    """A 1-D tensor backed by the file ``fd``: every process that maps the file sees the same memory."""
    return torch.frombuffer(mmap.mmap(fd, numel * dtype.itemsize), dtype=dtype, count=numel)


@dataclass(frozen=True)
class SharedNames:
    """What a learner needs to map the server's shared memory: the host, the files with their layouts, and the
    token in the header that proves a mapping is of the server's files."""

    host: str
    token: int
    header: str
    params: Files
    buffers: Files
    grads: dict[tuple[int, int], Files]  # (learner, optimizer) -> its gradient buffers


class SharedWeights(WeightsStore):
    """The server's side. It allocates every file (one owner for all of them), writes the weights under the
    sequence lock, and :meth:`unlink` removes the files (mappings already made stay valid). Raises OSError, with
    nothing left behind, where shared memory cannot be had."""

    def __init__(self, host: str, directory: Optional[str] = None) -> None:
        refused = shared_memory_refused(platform.machine())
        if refused is not None:
            raise OSError(refused)
        directory = directory or os.environ.get("LIGHTNING_RUDRA_SHM_DIR", SHM_DIR)
        self.host = host
        self.token = secrets.randbits(63)
        self.prefix = os.path.join(directory, f"lightning_rudra-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.files: dict[int, tuple[str, int, torch.dtype]] = {}  # data_ptr -> file
        self.paths: list[str] = []
        self.header = self.allocate("header", 3, torch.int64)  # [version, clock, token]
        self.header[2] = self.token

    def allocate(self, name: str, numel: int, dtype: torch.dtype) -> Tensor:
        path = f"{self.prefix}-{name}"
        try:
            tensor = _create(path, max(1, numel), dtype)[:numel]
        except OSError as error:
            self.unlink()
            raise OSError(
                f"cannot allocate {numel} x {dtype} of shared memory at {path}: {error}. Free space in "
                f"{os.path.dirname(path)} (df -h {os.path.dirname(path)}), or pass "
                "RudraStrategy(shared_memory=False) to send weights and gradients through RPC."
            ) from error
        self.paths.append(path)
        self.files[tensor.data_ptr()] = (path, numel, dtype)
        return tensor

    def allocate_grads(self, num_learners: int, layouts: Sequence[FlatLayout]) -> dict[tuple[int, int], list[Tensor]]:
        return {
            (learner, opt): [
                self.allocate(f"grad-{learner}-{opt}-{i}", numel, dtype)
                for i, (dtype, numel) in enumerate(layout.numels.items())
            ]
            for learner in range(num_learners)
            for opt, layout in enumerate(layouts)
        }

    def names(
        self, params: Sequence[Tensor], buffers: Sequence[Tensor], grads: dict[tuple[int, int], list[Tensor]]
    ) -> SharedNames:
        def files(tensors: Sequence[Tensor]) -> Files:
            return [self.files[t.data_ptr()] for t in tensors]

        return SharedNames(
            self.host,
            self.token,
            self.paths[0],
            files(params),
            files(buffers),
            {key: files(ts) for key, ts in grads.items()},
        )

    def begin(self) -> None:
        self.header[0] += 1

    def end(self, clock: int) -> None:
        self.header[1] = clock
        self.header[0] += 1

    @property
    def unlinked(self) -> bool:
        """The files are gone (the mappings stay valid): no process can map them any more."""
        return not self.paths

    def unlink(self) -> None:
        self.paths = remove(self.paths)


class MappedWeights:
    """A learner's mapping of the server's shared memory: its own gradient buffers, and the weights to read.

    Raises OSError if the files are missing or are not the server's (their token differs). ``server`` names the
    server in errors. A read fails when one update stays unfinished for ``timeout`` seconds (the version odd and
    unchanged: a server killed in the middle of an update leaves it so for good), or as soon as ``lost()`` says why
    the server is gone (the client's heartbeat). A reader that the server's updates keep overtaking (a copy slower
    than the gap between two updates, or updates in progress at every look) reads, once ``_OVERTAKEN`` updates
    began during the read, with ``pull()``: the weights, buffers and clock taken under the server's lock (an RPC
    pull)."""

    def __init__(
        self,
        names: SharedNames,
        learner: int,
        server: str,
        timeout: float,
        lost: Callable[[], Optional[str]],
        pull: Callable[[], tuple[list[Tensor], list[Tensor], int]],
    ) -> None:
        def mapped(files: Files) -> list[Tensor]:
            return [_open(path, max(1, numel), dtype)[:numel] for path, numel, dtype in files]

        self.header = _open(names.header, 3, torch.int64)
        if int(self.header[2]) != names.token:
            raise OSError(f"{names.header} is not the file the server made (its token differs)")
        self.params = mapped(names.params)
        self.buffers = mapped(names.buffers)
        self.grads = {opt: mapped(files) for (owner, opt), files in sorted(names.grads.items()) if owner == learner}
        self.server = server
        self.timeout = timeout
        self.lost = lost
        self.pull = pull

    def read(self, copy: Callable[[list[Tensor], list[Tensor]], None]) -> int:
        """Run ``copy(params, buffers)`` on a consistent snapshot of the server's weights; returns its clock."""
        writing: tuple[int, float] = (-1, 0.0)  # the odd version seen, and since when: one update in progress
        first = int(self.header[0])
        version = first
        # the updates begun since the first look: the odd versions after it (one in progress then is not one)
        while (version + 1) // 2 - (first + 1) // 2 < _OVERTAKEN:
            if version % 2:  # the server is writing an update: it takes milliseconds
                if version != writing[0]:  # another update than the one waited for: the server makes progress
                    writing = (version, time.monotonic())
                self._check_writer(writing[1])
                time.sleep(0.0002)
            else:
                copy(self.params, self.buffers)
                clock = int(self.header[1])
                if int(self.header[0]) == version:
                    return clock
            version = int(self.header[0])
        params, buffers, clock = self.pull()
        copy(params, buffers)
        return clock

    def _check_writer(self, since: float) -> None:
        lost = self.lost()
        if lost is not None:
            raise ServerLostError(f"{lost}. It went in the middle of an update of the weights in shared memory.")
        if time.monotonic() - since > self.timeout:
            raise ServerLostError(
                f"{self.server} has been in the middle of an update of the weights in shared memory "
                f"for more than {self.timeout:g} s (rpc_timeout): its process probably died while "
                "writing them. Its own output may say why."
            )
