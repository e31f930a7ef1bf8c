"""Shared memory between the server and the learners on its host: no bytes of weights or gradients through RPC.

The server keeps its master weights and buffers (flat, one buffer per dtype) in files under ``/dev/shm``, and
one gradient buffer per learner and optimizer. A learner on the same host maps them: a push is a copy of its
gradient into its buffer plus an RPC that carries only control (learner, optimizer, timestamp, learning
rates); a pull is one copy out of the server's weights. RPC pickles nothing large, and the server clones
nothing for a reply.

A pull must see one update's weights, not parts of two, without taking the server's lock for the copy: a
sequence lock. The server makes the version odd while it changes the weights and even again after, with the
new clock; a reader copies, then checks that the version was even and did not move, and copies again if it did.
"""

import os
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from lightning_rudra.core.flat import FlatLayout, WeightsStore

SHM_DIR = "/dev/shm"

Files = list[tuple[str, int, torch.dtype]]  # one (path, numel, dtype) per flat buffer


def _map(path: str, numel: int, dtype: torch.dtype) -> Tensor:
    """A 1-D tensor backed by ``path``: every process that maps the file sees the same memory."""
    return torch.from_file(path, shared=True, size=numel, dtype=dtype)


@dataclass(frozen=True)
class SharedNames:
    """What a learner needs to map the server's shared memory: the host, and the files with their layouts."""

    host: str
    header: str
    params: Files
    buffers: Files
    grads: dict[tuple[int, int], Files]  # (learner, optimizer) -> its gradient buffers


class SharedWeights(WeightsStore):
    """The server's side. It allocates every file (one owner for all of them), writes the weights under the
    sequence lock, and :meth:`unlink` removes the files (mappings already made stay valid)."""

    def __init__(self, host: str, directory: Optional[str] = None) -> None:
        directory = directory or os.environ.get("LIGHTNING_RUDRA_SHM_DIR", SHM_DIR)
        self.host = host
        self.prefix = os.path.join(directory, f"lightning_rudra-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.files: dict[int, tuple[str, int, torch.dtype]] = {}  # data_ptr -> file
        self.paths: list[str] = []
        self.header = self.allocate("header", 2, torch.int64)  # [version, clock]

    def allocate(self, name: str, numel: int, dtype: torch.dtype) -> Tensor:
        path = f"{self.prefix}-{name}"
        try:
            self.paths.append(path)
            tensor = _map(path, max(1, numel), dtype)[:numel]
        except RuntimeError as error:
            self.unlink()
            raise OSError(f"cannot allocate {numel} x {dtype} of shared memory at {path}: {error}. Free space in "
                          f"{os.path.dirname(path)} (df -h {os.path.dirname(path)}), or pass "
                          "RudraStrategy(shared_memory=False) to send weights and gradients through RPC.") from error
        self.files[tensor.data_ptr()] = (path, numel, dtype)
        return tensor

    def allocate_grads(self, num_learners: int, layouts: Sequence[FlatLayout]) -> dict[tuple[int, int], list[Tensor]]:
        return {(learner, opt): [self.allocate(f"grad-{learner}-{opt}-{i}", numel, dtype)
                                 for i, (dtype, numel) in enumerate(layout.numels.items())]
                for learner in range(num_learners) for opt, layout in enumerate(layouts)}

    def names(self, params: Sequence[Tensor], buffers: Sequence[Tensor],
              grads: dict[tuple[int, int], list[Tensor]]) -> SharedNames:
        def files(tensors: Sequence[Tensor]) -> Files:
            return [self.files[t.data_ptr()] for t in tensors]

        return SharedNames(self.host, self.paths[0], files(params), files(buffers),
                           {key: files(ts) for key, ts in grads.items()})

    def begin(self) -> None:
        self.header[0] += 1

    def end(self, clock: int) -> None:
        self.header[1] = clock
        self.header[0] += 1

    def unlink(self) -> None:
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.paths = []


class MappedWeights:
    """A learner's mapping of the server's shared memory: its own gradient buffers, and the weights to read."""

    def __init__(self, names: SharedNames, learner: int) -> None:
        def mapped(files: Files) -> list[Tensor]:
            return [_map(path, max(1, numel), dtype)[:numel] for path, numel, dtype in files]

        self.header = _map(names.header, 2, torch.int64)
        self.params = mapped(names.params)
        self.buffers = mapped(names.buffers)
        self.grads = {opt: mapped(files) for (owner, opt), files in sorted(names.grads.items()) if owner == learner}

    def read(self, copy: Callable[[list[Tensor], list[Tensor]], None]) -> int:
        """Run ``copy(params, buffers)`` on a consistent snapshot of the server's weights; returns its clock."""
        while True:
            version = int(self.header[0])
            if version % 2:  # the server is writing an update: it takes milliseconds
                time.sleep(0.0002)
                continue
            copy(self.params, self.buffers)
            clock = int(self.header[1])
            if int(self.header[0]) == version:
                return clock
