"""Compressed pushes: gradients that travel in RPC messages (to a server on another host) sent in bfloat16, half
the bytes of float32, with error feedback. Plain torch.

Rounding a gradient g to bfloat16 loses up to half a unit in its last place (8 bits of mantissa: about 0.4 % of
each element). Error feedback keeps that error: the learner adds what was lost from its previous push to the next
gradient before rounding it, so that over k pushes the server has received the sum of the k gradients less only the
error of the last rounding, whatever k. Gradients through shared memory (on the server's own host) are not
compressed.

The weights a server sends back through RPC travel as bfloat16 differences from the weights that learner already
holds (:class:`WeightDeltas`): both sides keep the same float32 copy and add each rounded difference to it, so the
next difference carries what the last rounding lost (error feedback again), and a learner's weights differ from the
server's only by the rounding of the last difference, which is small beside the difference itself.
"""

from typing import Hashable, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from lightning_rudra.core.errors import ConfigurationError

COMPRESSIONS = {"bf16": torch.bfloat16}  # name -> the dtype float32 gradients travel in


def compression_option(compression: Optional[str]) -> Optional[str]:
    """``compression`` checked: None (also ``"none"``: full precision) or a name in :data:`COMPRESSIONS`."""
    if compression is None or compression == "none":
        return None
    if compression not in COMPRESSIONS:
        raise ConfigurationError(
            f"compression={compression!r} is not supported: expected None (gradients in full precision) or "
            f"{', '.join(map(repr, COMPRESSIONS))} (gradients pushed through RPC in bfloat16, with error feedback)."
        )
    return compression


class ErrorFeedback:
    """Rounds float32 flat gradients to the wire dtype of ``compression``, keeping each one's rounding error to add
    to the next gradient of the same ``key`` (what was pushed: a server's part of an optimizer's gradient, of one
    learner). Gradients of other dtypes travel as they are."""

    def __init__(self, compression: str) -> None:
        self.compression = compression
        self.dtype = COMPRESSIONS[compression]
        self.residuals: dict[Hashable, list[Optional[Tensor]]] = {}

    def compress(self, key: Hashable, flats: Sequence[Tensor]) -> list[Tensor]:
        """``flats`` in the wire dtype, each with the error of ``key``'s previous push added before rounding.
        ``flats`` must be the caller's own copies: they become the new errors. A gradient with NaN or Inf (which
        the server refuses) keeps no error: it would spoil every later push."""
        residuals = self.residuals.setdefault(key, [None] * len(flats))
        wire = []
        for i, flat in enumerate(flats):
            if flat.dtype != torch.float32:
                wire.append(flat)
                continue
            kept = residuals[i]
            if kept is not None:
                flat.add_(kept)
            rounded = flat.to(self.dtype)
            # exact in float32: the rounded value holds flat's leading bits, the error the rest
            error = flat.sub_(rounded)
            # the errors are tiny, so their sum overflows only if one is NaN (from a NaN or Inf in the gradient)
            residuals[i] = error if bool(torch.isfinite(error.sum())) else None
            wire.append(rounded)
        return wire


def decompress(flats: Sequence[Tensor], dtypes: Sequence[torch.dtype]) -> list[Tensor]:
    """Flat gradients as pushed, in the dtypes of their layout (``dtypes``): a compressed one (a wire dtype where the
    layout holds float32) widened; anything else as it came, for the server's checks to judge."""
    wire = set(COMPRESSIONS.values())
    return [
        flat.to(dtype) if isinstance(flat, Tensor) and flat.dtype in wire and dtype == torch.float32 else flat
        for flat, dtype in zip(flats, dtypes)
    ] + list(flats[len(dtypes) :])


class WeightMessage(NamedTuple):
    """Weights as :class:`WeightDeltas` sends them: ``whole`` (the float32 weights themselves) or the float32
    flats' differences in the wire dtype (the others as they are)."""

    whole: bool
    flats: list[Tensor]


class WeightDeltas:
    """Flat weights sent to a learner as differences from the copy it holds, its float32 flats' differences rounded
    to the wire dtype of ``compression``; the sender and the receiver each keep one (``key``: the learner, on the
    server). Both apply the same float32 additions, so their copies stay equal bit for bit while no message is lost;
    ``count``, the messages applied so far, tells them apart when one was: the receiver sends its count with each
    request and a sender whose count differs (or that has no copy: a new process) sends the whole weights again."""

    def __init__(self, compression: str) -> None:
        self.compression = compression
        self.dtype = COMPRESSIONS[compression]
        self.held: dict[Hashable, tuple[int, list[Tensor]]] = {}  # key -> (count, the copy the receiver holds)

    def count(self, key: Hashable = None) -> int:
        return self.held[key][0] if key in self.held else 0

    def encode(self, key: Hashable, count: int, flats: Sequence[Tensor]) -> WeightMessage:
        """The message for ``flats`` to a receiver that has applied ``count`` messages: the differences from its
        copy, or the whole weights when its copy is not the one kept here."""
        kept, copy = self.held.get(key, (0, []))
        if count == 0 or count != kept:
            self.held[key] = (1, [flat.clone() for flat in flats])
            return WeightMessage(True, list(flats))
        wire = []
        for held, flat in zip(copy, flats):
            if held.dtype == torch.float32:
                delta = (flat - held).to(self.dtype)
                held.add_(delta)
                wire.append(delta)
            else:
                held.copy_(flat)
                wire.append(flat)
        self.held[key] = (kept + 1, copy)
        return WeightMessage(False, wire)

    def decode(self, message: WeightMessage, key: Hashable = None) -> list[Tensor]:
        """The weights ``message`` stands for: this side's copy, brought up to date (the tensors returned are the
        copy itself: read them, do not change them)."""
        if message.whole:
            self.held[key] = (1, [flat.clone() for flat in message.flats])
            return self.held[key][1]
        kept, copy = self.held[key]
        for held, flat in zip(copy, message.flats):
            held.add_(flat) if held.dtype == torch.float32 else held.copy_(flat)
        self.held[key] = (kept + 1, copy)
        return copy
