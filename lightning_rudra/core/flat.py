"""Flat buffers: many tensors packed into one contiguous tensor per dtype, and where the server keeps them.

A push or a pull then moves a few large buffers instead of one message per parameter. Plain torch.
"""

from typing import Optional, Sequence

import torch
from torch import Tensor


class FlatLayout:
    """Packs a fixed list of tensors into one flat contiguous tensor per dtype, and back into views.

    A push or a pull then moves a few large buffers instead of one message per parameter. Learner and
    server build the layout from the same list, so the packing agrees on both sides.
    """

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self.shapes = [t.shape for t in tensors]
        self.groups: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            self.groups.setdefault(t.dtype, []).append(i)
        self.numels = {dtype: sum(self.shapes[i].numel() for i in idx) for dtype, idx in self.groups.items()}

    def __len__(self) -> int:
        return len(self.shapes)

    def pack(self, tensors: Sequence[Tensor], device: Optional[torch.device] = None) -> list[Tensor]:
        """One new contiguous tensor per dtype (a copy: safe to send while the originals change)."""
        return [
            torch.cat([tensors[i].detach().reshape(-1) for i in idx]).to(device) if idx else torch.empty(0, dtype=dtype)
            for dtype, idx in self.groups.items()
        ]

    def pack_into(self, tensors: Sequence[Tensor], flats: Sequence[Tensor]) -> None:
        """Copy ``tensors`` into existing flat buffers (one per dtype), allocating nothing on the CPU."""
        for flat, idx in zip(flats, self.groups.values()):
            parts = [tensors[i].detach().reshape(-1) for i in idx]
            if parts and parts[0].device == flat.device:
                torch.cat(parts, out=flat)
            elif parts:
                flat.copy_(torch.cat(parts))

    def unpack(self, flats: Sequence[Tensor]) -> list[Tensor]:
        """Views into ``flats``, in the original order and shapes."""
        out: list[Optional[Tensor]] = [None] * len(self.shapes)
        for flat, idx in zip(flats, self.groups.values()):
            offset = 0
            for i in idx:
                numel = self.shapes[i].numel()
                out[i] = flat[offset : offset + numel].view(self.shapes[i])
                offset += numel
        return out  # type: ignore[return-value]

    def check(self, flats: Sequence[Tensor], what: str) -> None:
        """Raise a ValueError naming the mismatch if ``flats`` was not packed with this layout."""
        expected = [f"{dtype} x {numel}" for dtype, numel in self.numels.items()]
        if not isinstance(flats, (list, tuple)):  # a tensor would pass as its rows
            raise ValueError(
                f"{what} are a {type(flats).__name__}: expected a list of flat buffers [{', '.join(expected)}] "
                "(dtype x number of elements, one 1-D buffer per dtype)."
            )
        got = [
            f"{f.dtype} x {f.numel()}" + ("" if f.dim() == 1 else f" ({f.dim()}-D)")
            if isinstance(f, Tensor)
            else type(f).__name__
            for f in flats
        ]
        if got != expected:
            raise ValueError(
                f"{what} has flat buffers [{', '.join(got)}]: expected [{', '.join(expected)}] "
                "(dtype x number of elements, one 1-D buffer per dtype)."
            )


class WeightsStore:
    """Where the server keeps its flat weights and buffers: plain memory here. Shared memory
    (:class:`lightning_rudra.transport.shm.SharedWeights`) also tells its readers when the weights change."""

    def allocate(self, name: str, numel: int, dtype: torch.dtype) -> Tensor:
        return torch.empty(numel, dtype=dtype)

    def begin(self) -> None:
        """The weights are about to change."""

    def end(self, clock: int) -> None:
        """The weights have changed: they are now those of ``clock``."""
