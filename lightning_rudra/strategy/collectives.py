"""Collectives through the parameter server, for a strategy that has no torch.distributed process group.

Lightning calls barrier, broadcast, reduce and all_gather (checkpoints, ``self.log(sync_dist=True)``, early
stopping), and torchmetrics syncs its states; all of them meet on the server as one gather. Every learner must
call them in the same order. Under the shared epoch the learners take different numbers of batches, so
during a training batch (its hooks, ``training_step``, the optimizer step) no call is made by all of them:
there ``reduce``, ``broadcast``, ``barrier`` and metric syncs stay local (each learner logs its own value, and
decides for itself, e.g. the Timer of ``max_time``), and ``all_gather`` is refused with a message that says why.
With ``min_learners``, a lost learner's part is left out: a reduction covers the learners left.
"""

from typing import Any, Callable, Optional, Union

import torch
from lightning_fabric.utilities.types import ReduceOp
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torchmetrics import Metric

from lightning_rudra.learner.client import LearnerClient

_REDUCTIONS: dict[str, Callable[..., Tensor]] = {
    "sum": torch.sum,
    "mean": torch.mean,
    "avg": torch.mean,
    "max": torch.amax,
    "min": torch.amin,
    "product": torch.prod,
}


class Collectives:
    """The collectives of :class:`~lightning_rudra.RudraStrategy`: through the first server's client while a stage
    has one (:meth:`connect`), else each learner's own value (one process, or a simulated run). ``in_batch`` says
    whether this learner is inside a training batch of the shared epoch, where the learners are not in step (see
    the module doc)."""

    def __init__(self, in_batch: Callable[[], bool]) -> None:
        self.in_batch = in_batch
        self.client: Optional[LearnerClient] = None
        self.device = torch.device("cpu")  # where received tensors go
        self.joining = False  # a process rejoining a run: its collectives are its own until its first epoch

    def connect(self, client: LearnerClient, device: torch.device, joining: bool = False) -> None:
        """Through ``client``'s server for this stage; ``joining``: this process takes a lost learner's place, and
        its collectives are its own until :meth:`rejoined`."""
        self.client, self.device, self.joining = client, device, joining

    def rejoined(self) -> None:
        """This process's first epoch in the run starts: its collectives meet the others' from here on."""
        self.joining = False

    def close(self) -> None:
        """The stage is over: metrics pointed at the server sync locally again."""
        self.client = None

    def _local_only(self) -> bool:
        return self.client is None or self.joining or self.in_batch()

    def _gather(self, obj: Any) -> dict[int, Any]:
        """learner -> its ``obj``, for every learner left."""
        assert self.client is not None
        sent = apply_to_collection(obj, Tensor, lambda t: t.detach().cpu())  # the server holds CPU tensors
        return self.client.gather(sent)

    def sync_metrics(self, module: torch.nn.Module) -> None:
        """torchmetrics syncs over torch.distributed, which this strategy leaves uninitialized on purpose:
        point the module's metrics at the server instead, so that e.g. a logged accuracy covers all learners."""
        for metric in module.modules():
            if isinstance(metric, Metric):
                metric.dist_sync_fn = self._gather_metric_state
                metric.distributed_available_fn = self._connected

    def _connected(self) -> bool:
        return self.client is not None

    def _gather_metric_state(self, tensor: Tensor, group: Optional[Any] = None) -> list[Tensor]:
        if self._local_only():
            return [tensor]
        return [t.to(tensor.device) for t in self._gather(tensor).values()]

    def barrier(self) -> None:
        if not self._local_only():
            self._gather(None)

    def broadcast(self, obj: Any, src: int, rank: int) -> Any:
        if self._local_only():
            return obj
        gathered = self._gather(obj if rank == src else None)
        if src not in gathered:
            raise RuntimeError(f"broadcast from learner {src}, which was lost: there is nothing to receive.")
        return apply_to_collection(gathered[src], Tensor, lambda t: t.to(self.device))

    def reduce(self, tensor: Any, reduce_op: Optional[Union[ReduceOp, str]]) -> Any:
        reduce = _REDUCTIONS[_reduce_op_name(reduce_op)]
        if not isinstance(tensor, Tensor) or self._local_only():
            return tensor
        stacked = torch.stack(list(self._gather(tensor).values()))
        if stacked.dtype in (torch.bool, torch.int32, torch.int64) and reduce is torch.mean:
            stacked = stacked.float()
        return reduce(stacked, dim=0).to(device=tensor.device)

    def all_gather(self, tensor: Tensor, sync_grads: bool = False) -> Tensor:
        if sync_grads:
            raise NotImplementedError(
                "RudraStrategy.all_gather(sync_grads=True) is not supported: gathered "
                "tensors travel through the server, without autograd."
            )
        if self.client is None or self.joining:
            return tensor
        if self.in_batch():
            raise RuntimeError(
                "all_gather was called during a training batch under RudraStrategy's shared epoch: learners take "
                "different numbers of batches, so no batch is shared by all of them. Move it to an epoch hook "
                "(e.g. on_train_epoch_end), or use RudraStrategy(sampling='static')."
            )
        return torch.stack(list(self._gather(tensor).values())).to(tensor.device)


def _reduce_op_name(reduce_op: Optional[Union[ReduceOp, str]]) -> str:
    if reduce_op is None:
        return "mean"
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
    else:
        name = next((n for n in ("SUM", "MAX", "MIN", "PRODUCT", "AVG") if reduce_op == getattr(ReduceOp, n)), "")
        name = name.lower()
    if name not in _REDUCTIONS:
        raise ValueError(
            f"reduce_op={reduce_op!r} is not supported by RudraStrategy.reduce: expected one of "
            f"{sorted(_REDUCTIONS)} or the matching torch.distributed.ReduceOp."
        )
    return name
