"""Compressed pushes: gradients that travel in RPC messages (to a server on another host) sent in bfloat16, half
the bytes of float32, with error feedback. Plain torch.

Rounding a gradient g to bfloat16 loses up to half a unit in its last place (8 bits of mantissa: about 0.4 % of
each element). Error feedback keeps that error: the learner adds what was lost from its previous push to the next
gradient before rounding it, so that over k pushes the server has received the sum of the k gradients less only the
error of the last rounding, whatever k. Gradients through shared memory (on the server's own host) are not
compressed; the weights that come back are not either (every learner and the server hold the same float32 weights).
"""

from typing import Hashable, Optional, Sequence

import torch
from torch import Tensor

COMPRESSIONS = {"bf16": torch.bfloat16}  # name -> the dtype float32 gradients travel in


def compression_option(compression: Optional[str]) -> Optional[str]:
    """``compression`` checked: None (also ``"none"``: full precision) or a name in :data:`COMPRESSIONS`."""
    if compression is None or compression == "none":
        return None
    if compression not in COMPRESSIONS:
        raise ValueError(
            f"compression={compression!r} is not supported: expected None (gradients in full precision) or "
            f"{', '.join(map(repr, COMPRESSIONS))} (gradients pushed through RPC in bfloat16, with error feedback)."
        )
    return compression


class ErrorFeedback:
    """Rounds float32 flat gradients to the wire dtype of ``compression``, keeping each one's rounding error to add
    to the next gradient of the same ``key`` (what was pushed: a server's part of an optimizer's gradient, of one
    learner). Gradients of other dtypes travel as they are."""

    def __init__(self, compression: str) -> None:
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
