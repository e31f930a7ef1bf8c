"""The model cut into shards for several server processes (``num_servers``): each owns one contiguous part of
the model's parameters, flattened one after the other, and runs the protocol on it alone. Plain torch.

A cut may fall inside a parameter: each side then holds a flat slice of it. That is exact for optimizers that
update every element on its own (SGD, Adam and the others in :data:`ELEMENTWISE`); for any other (one that looks
at a whole tensor: its norm, its shape) the cuts fall between parameters, each whole on one server. The optimizer
states are split at the same cuts when a checkpoint is restored and merged back when one is written, so a
checkpoint does not depend on the number of servers.
"""

from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
from torch import Tensor

from lightning_rudra.core.errors import ConfigurationError
from lightning_rudra.core.compensation import RULES_STATE
from lightning_rudra.core.optimizers import OptimizerSpec

# torch.optim classes whose update and state are elementwise: a slice of a parameter steps as the whole would
# (exactly these classes: a subclass may step otherwise)
ELEMENTWISE = frozenset(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "Rprop", "ASGD")
)


@dataclass(frozen=True)
class Piece:
    """Elements ``start:stop`` of model parameter ``param``, flattened; ``whole``: all of it, in its own shape."""

    param: int
    start: int
    stop: int
    whole: bool


def piece_view(tensor: Tensor, piece: Piece) -> Tensor:
    return tensor if piece.whole else tensor.reshape(-1)[piece.start : piece.stop]


def parts(tensors: Sequence[Tensor], owned: Sequence[tuple[int, Piece]]) -> list[Tensor]:
    """The parts of ``tensors`` (one per position of an optimizer's parameters) that ``owned``
    (:meth:`ShardPlan.owned`) names, as :meth:`ShardPlan.views` cuts them."""
    return [piece_view(tensors[position], piece) for position, piece in owned]


def cuts_parameters(specs: Sequence[OptimizerSpec]) -> bool:
    """Whether the cuts may fall inside a parameter: only if every optimizer is elementwise."""
    return all(spec.cls in ELEMENTWISE for spec in specs)


class ShardPlan:
    """Cuts the model's parameters (their shapes, in the module's order) into ``num_shards`` contiguous parts of
    (nearly) equal numbers of elements, or, with ``whole``, at the parameter boundaries nearest to those cuts (a
    part may then be empty)."""

    def __init__(self, shapes: Sequence[torch.Size], num_shards: int, whole: bool = False) -> None:
        numels = [shape.numel() for shape in shapes]
        total = sum(numels)
        if num_shards > max(1, total) and not whole:
            raise ConfigurationError(
                f"num_servers={num_shards} is more than the model's {total} parameter elements: "
                "every server must own at least one. Use fewer servers."
            )
        self.shapes = list(shapes)
        cuts = [total * s // num_shards for s in range(num_shards + 1)]
        if whole:
            bounds = [sum(numels[:i]) for i in range(len(numels) + 1)]
            cuts = [min(bounds, key=lambda bound: (abs(bound - cut), bound)) for cut in cuts]
        self.shards: list[list[Piece]] = [[] for _ in range(num_shards)]
        offset = 0
        for param, numel in enumerate(numels):
            if numel == 0:  # nothing to cut: shard 0 keeps it, so that every parameter has a home
                self.shards[0].append(Piece(param, 0, 0, True))
            for shard in range(num_shards):
                start, stop = max(cuts[shard], offset), min(cuts[shard + 1], offset + numel)
                if start < stop:
                    self.shards[shard].append(Piece(param, start - offset, stop - offset, stop - start == numel))
            offset += numel

    def __len__(self) -> int:
        return len(self.shards)

    @property
    def splits_a_parameter(self) -> bool:
        return any(not piece.whole for pieces in self.shards for piece in pieces)

    def views(self, shard: int, tensors: Sequence[Tensor]) -> list[Tensor]:
        """The parts of ``tensors`` (one per model parameter) that ``shard`` owns: the tensor itself where it owns
        all of it, else a flat view of its slice (a copy if the tensor is not contiguous: fine to read)."""
        return [piece_view(tensors[piece.param], piece) for piece in self.shards[shard]]

    def spec(self, shard: int, spec: OptimizerSpec) -> OptimizerSpec:
        """``spec`` over the pieces ``shard`` owns. Every group is kept, empty or not: every server holds every
        optimizer and takes every push, so that all count the same updates and gradients."""
        local = {p.param: k for k, p in enumerate(self.shards[shard])}
        return replace(spec, groups=[([local[i] for i in idx if i in local], hp) for idx, hp in spec.groups])

    def owned(self, shard: int, order: Sequence[int]) -> list[tuple[int, Piece]]:
        """(position in ``order``, piece) of the parameters in ``order`` that ``shard`` owns, in that order: the
        order of the shard optimizer's state."""
        pieces = {p.param: p for p in self.shards[shard]}
        return [(position, pieces[i]) for position, i in enumerate(order) if i in pieces]

    def split_state(self, shard: int, order: Sequence[int], state: dict[str, Any]) -> dict[str, Any]:
        """The part of an optimizer's state dict (of the parameters ``order``, model indices in its groups'
        order) that ``shard``'s optimizer loads; with the compensation rules' state, cut alike."""
        owned = self.owned(shard, order)
        saved = state["state"]
        shard_state: dict[Any, Any] = self._split_entries(owned, saved)
        if RULES_STATE in saved:
            shard_state[RULES_STATE] = self._split_entries(owned, saved[RULES_STATE])
        local = {position: k for k, (position, _) in enumerate(owned)}
        groups = [
            {**group, "params": [local[p] for p in group["params"] if p in local]} for group in state["param_groups"]
        ]
        return {"state": shard_state, "param_groups": groups}

    def _split_entries(self, owned: Sequence[tuple[int, Piece]], saved: dict[Any, Any]) -> dict[int, Any]:
        """Per-parameter entries (position -> {name: value}) cut to ``owned``'s pieces, at their local positions."""
        entries = {}
        for k, (position, piece) in enumerate(owned):
            entry = saved.get(position, saved.get(str(position)))
            if entry is not None:
                entries[k] = entry if piece.whole else {key: self._slice(value, piece) for key, value in entry.items()}
        return entries

    def merge_states(self, order: Sequence[int], states: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """The whole optimizer's state (positions in ``order``) from its shards' states (shard -> state dict), with
        the compensation rules' state merged alike."""
        merged: dict[Any, Any] = self._merge_entries(order, {s: state["state"] for s, state in states.items()})
        rules = {s: state["state"][RULES_STATE] for s, state in states.items() if RULES_STATE in state["state"]}
        if rules:
            merged[RULES_STATE] = self._merge_entries(order, rules)
        return {"state": merged, "param_groups": []}

    def _merge_entries(self, order: Sequence[int], shards: dict[int, dict[Any, Any]]) -> dict[int, Any]:
        """Per-parameter entries of the whole (positions in ``order``) from the shards' (shard -> entries)."""
        parts: dict[int, list[tuple[Piece, dict[str, Any]]]] = {}
        for shard, entries in sorted(shards.items()):
            for k, (position, piece) in enumerate(self.owned(shard, order)):
                entry = entries.get(k)
                if entry is not None:
                    parts.setdefault(position, []).append((piece, entry))
        merged = {}
        for position, pieces in sorted(parts.items()):
            piece, first = pieces[0]
            if piece.whole:
                merged[position] = first
                continue
            shape = self.shapes[piece.param]
            merged[position] = {
                key: torch.cat([entry[key].reshape(-1) for _, entry in pieces]).view(shape)
                if self._sliced(value, piece)
                else value
                for key, value in first.items()
            }
        return merged

    @staticmethod
    def _sliced(value: Any, piece: Piece) -> bool:
        """A state entry of a slice is elementwise (a moment, a momentum) if it has the slice's size."""
        return isinstance(value, Tensor) and value.dim() > 0 and value.numel() == piece.stop - piece.start

    def _slice(self, value: Any, piece: Piece) -> Any:
        if isinstance(value, Tensor) and value.dim() > 0 and value.numel() == self.shapes[piece.param].numel():
            return value.reshape(-1)[piece.start : piece.stop].clone()
        return value
