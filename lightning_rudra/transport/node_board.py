"""Shared memory among the learners of one node that aggregate their pushes to a server on another host
(:mod:`lightning_rudra.core.node_plan`): a :class:`NodeBoard` per (node, server). The node's first learner (the leader)
creates its files in ``/dev/shm``; the others map them. Each member has a slot: a few control words and its gradient,
``has_grad`` and buffers of each round; the leader writes the weights the server gave back for the round and the
reply's words, which every member copies.

No sequence lock is needed: a member writes its slot for round r + 1 only after it has read round r's weights, and the
leader writes round r + 1's weights only once every member has posted round r + 1. Control words are written after
the data they announce and, like :mod:`lightning_rudra.transport.shm`, rely on x86's store order (refused elsewhere
by the same check). The files are unlinked as soon as every member has mapped them: nothing is left in /dev/shm.
"""

import os
import secrets
import uuid
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_rudra.transport.shm import SHM_DIR, Files, _create, _open, remove

# Control words of a slot
POSTED = 0  # the round whose gradient the slot holds (0: none yet)
BEAT = 1  # bumped by the learner's heartbeat thread: a sign of life
PID = 2
STATE = 3  # RUNNING, DONE (stopped pushing) or FAILED
OPTIMIZER = 4  # the optimizer of the posted gradient
FINITE = 5  # 1 if the posted gradient is finite
CONTROL = 6
RUNNING, DONE, FAILED = 0, 1, 2

# The header: the token, then the reply's words, written by the leader: the round whose weights are in place, then
# the reply's clock, σ and status (an index into the learner's severities)
ROUND, CLOCK, STALENESS, STATUS = 1, 2, 3, 4
HEADER = 5


@dataclass(frozen=True)
class BoardLayout:
    """What a board holds: its members, and per optimizer the flat gradient buffers (dtype, numel) and the number
    of parameters (``has_grad``) of the server's part; the flat weights and buffers of that part."""

    members: tuple[int, ...]
    grads: tuple[tuple[tuple[torch.dtype, int], ...], ...]
    num_params: tuple[int, ...]
    params: tuple[tuple[torch.dtype, int], ...]
    buffers: tuple[tuple[torch.dtype, int], ...]


@dataclass(frozen=True)
class BoardNames:
    """What a member needs to map the leader's board: the files (in allocation order) and the token that proves
    a mapping is of the leader's files."""

    token: int
    files: Files


class Slot:
    """One member's part of the board."""

    def __init__(self, control: Tensor, grads: list[list[Tensor]], has_grad: list[Tensor], buffers: list[Tensor]):
        self.control = control
        self.grads = grads  # per optimizer, one flat buffer per dtype
        self.has_grad = has_grad  # per optimizer (uint8)
        self.buffers = buffers


class NodeBoard:
    """The board's tensors, created by the leader (:meth:`create`) or mapped by a member (:meth:`open`). Raises
    OSError where the files cannot be made or are not the leader's."""

    def __init__(self, layout: BoardLayout, tensors: list[Tensor], paths: list[str]) -> None:
        self.layout = layout
        self.paths = paths
        self.files: Files = []
        it = iter(tensors)
        self.header = next(it)  # [token, reply words...]
        self.lr_scale = next(it)  # float64, the reply's
        self.slots: dict[int, Slot] = {}
        for member in layout.members:
            control = next(it)
            grads = [[next(it) for _ in flats] for flats in layout.grads]
            has_grad = [next(it) for _ in layout.num_params]
            buffers = [next(it) for _ in layout.buffers]
            self.slots[member] = Slot(control, grads, has_grad, buffers)
        self.params = [next(it) for _ in layout.params]
        self.buffers = [next(it) for _ in layout.buffers]

    @staticmethod
    def _shapes(layout: BoardLayout) -> list[tuple[str, int, torch.dtype]]:
        shapes = [("header", HEADER, torch.int64), ("lr", 1, torch.float64)]
        for member in layout.members:
            shapes.append((f"control-{member}", CONTROL, torch.int64))
            shapes += [
                (f"grad-{member}-{o}-{i}", n, d) for o, fl in enumerate(layout.grads) for i, (d, n) in enumerate(fl)
            ]
            shapes += [(f"has-{member}-{o}", n, torch.uint8) for o, n in enumerate(layout.num_params)]
            shapes += [(f"buffer-{member}-{i}", n, d) for i, (d, n) in enumerate(layout.buffers)]
        shapes += [(f"param-{i}", n, d) for i, (d, n) in enumerate(layout.params)]
        shapes += [(f"weights-buffer-{i}", n, d) for i, (d, n) in enumerate(layout.buffers)]
        return shapes

    @classmethod
    def create(cls, layout: BoardLayout, directory: Optional[str] = None) -> "NodeBoard":
        directory = directory or os.environ.get("LIGHTNING_RUDRA_SHM_DIR", SHM_DIR)
        prefix = os.path.join(directory, f"lightning_rudra-node-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        tensors, paths, files = [], [], []
        try:
            for name, numel, dtype in cls._shapes(layout):
                path = f"{prefix}-{name}"
                tensors.append(_create(path, max(1, numel), dtype)[:numel])
                paths.append(path)
                files.append((path, numel, dtype))
        except OSError:
            remove(paths)
            raise
        board = cls(layout, tensors, paths)
        board.files = files
        board.header[1:] = 0
        board.header[0] = secrets.randbits(63)
        return board

    @property
    def names(self) -> BoardNames:
        return BoardNames(int(self.header[0]), list(self.files))

    @classmethod
    def open(cls, layout: BoardLayout, names: BoardNames) -> "NodeBoard":
        tensors = [_open(path, max(1, numel), dtype)[:numel] for path, numel, dtype in names.files]
        if int(tensors[0][0]) != names.token:
            raise OSError(f"{names.files[0][0]} is not the file the node's first learner made (its token differs)")
        return cls(layout, tensors, [])

    def unlink(self) -> None:
        """Every member has mapped the files (their mappings stay valid): remove them."""
        self.paths = remove(self.paths)


def board_layout(
    members: Sequence[int], grads: Sequence[dict[torch.dtype, int]], num_params: Sequence[int], params, buffers
) -> BoardLayout:
    """A :class:`BoardLayout` from flat layouts' ``numels`` (dtype -> numel)."""
    return BoardLayout(
        tuple(members),
        tuple(tuple(g.items()) for g in grads),
        tuple(num_params),
        tuple(params.items()),
        tuple(buffers.items()),
    )
