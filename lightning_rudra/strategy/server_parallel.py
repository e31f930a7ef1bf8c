"""What RudraStrategy keeps of Lightning's ParallelStrategy without the torch.distributed process group it has on
purpose none of (why: ``rudra.py``): one process per device on every node, ranked by the cluster environment, and
collectives through the parameter server (``collectives.py``)."""

from typing import Any, Callable, Optional, Union

import torch
from lightning_fabric.utilities.types import ReduceOp
from pytorch_lightning.strategies import ParallelStrategy
from torch import Tensor
from typing_extensions import override

from lightning_rudra.strategy.collectives import Collectives


class ServerParallelStrategy(ParallelStrategy):
    """Ranks, devices and collectives of a ParallelStrategy whose learners meet only on the server. ``in_batch``
    says whether this learner is inside a training batch of the shared epoch (see ``collectives.py``);
    ``plugins``: ParallelStrategy's arguments."""

    def __init__(self, in_batch: Callable[[], bool], **plugins: Any) -> None:
        super().__init__(**plugins)  # the subclass's signature names and types them (LightningCLI reads it)
        self._num_nodes = 1
        self._collectives = Collectives(in_batch)  # through the server, once a stage has one (the subclass connects it)

    # ---- ranks and devices ---------------------------------------------------------------------------
    @override
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Makes Lightning split the data into parts with a DistributedSampler and sync ``self.log(..., sync_dist=True)``."""
        return True

    @override
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)

    # ---- collectives, through the server (lightning_rudra.strategy.collectives) -----------------------
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        self._collectives.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._collectives.broadcast(obj, src, self.global_rank)

    @override
    def reduce(
        self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Any:
        return self._collectives.reduce(tensor, reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        return self._collectives.all_gather(tensor, sync_grads)
