"""A learner: a module whose optimizer steps go through the parameter server (push, then pull).

On the server's host, gradients and weights move through shared memory (:mod:`lightning_rudra.shm`) and RPC
carries only control; elsewhere, or with ``shared_memory=False``, they travel in the RPC messages.
Lightning-free: :class:`LearnerOptimizer` wraps any torch optimizer, so a plain training loop can use it
as well as the strategy.
"""

import socket
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor
from torch.futures import Future
from torch.optim import Optimizer

from lightning_rudra.client import LearnerClient
from lightning_rudra.flat import FlatLayout
from lightning_rudra.optimizers import OptimizerSpec, hyperparameters
from lightning_rudra.protocol import ProtocolConfig, Stats
from lightning_rudra.shm import MappedWeights

_CPU = torch.device("cpu")


class Learner:
    """Moves a module's gradients to the server and the server's weights into the module."""

    def __init__(self, module: torch.nn.Module, client: LearnerClient, overlap: bool = False,
                 shared_memory: bool = True) -> None:
        self.client = client
        self.overlap = overlap
        self.shared_memory = shared_memory
        self.shm: Optional[MappedWeights] = None
        self._attached = False
        self._in_flight: Optional[tuple[Future, int]] = None  # the push (and its optimizer) not yet settled
        self.params = list(module.parameters())
        self.buffers = list(module.buffers())
        self.param_layout = FlatLayout(self.params)
        self.buffer_layout = FlatLayout(self.buffers)
        self.optimizer_params: list[list[Tensor]] = []  # per wrapped optimizer, in its groups' order
        self.grad_layouts: list[FlatLayout] = []
        # per optimizer: the timestamp of the oldest weights its gradient holds a contribution of (None: none yet)
        self.grad_timestamps: list[Optional[int]] = []
        self._hooks: list[Any] = []
        # (optimizer, status, staleness, lr_scale) of every push: see LearnerClient.receive
        self.on_push: Optional[Callable[[int, str, int, float], None]] = None

    def wrap(self, optimizers: Sequence[Optimizer]) -> list["LearnerOptimizer"]:
        """Wrap the learner's optimizers; their steps push from now on."""
        self.optimizer_params = [[p for g in opt.param_groups for p in g["params"]] for opt in optimizers]
        self.grad_layouts = [FlatLayout(params) for params in self.optimizer_params]
        self.grad_timestamps = [None] * len(optimizers)
        for index, params in enumerate(self.optimizer_params):
            for p in params:
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._stamp(index)))
        return [LearnerOptimizer(opt, i, self) for i, opt in enumerate(optimizers)]

    def _stamp(self, index: int) -> Callable[[Tensor], None]:
        """A gradient comes from the weights its backward ran on, which may be older than the newest received
        (one backward, then two optimizers' steps; a pull in the middle of gradient accumulation)."""
        def hook(param: Tensor) -> None:
            if self.grad_timestamps[index] is None:
                self.grad_timestamps[index] = self.client.timestamp
        return hook

    def unwrap(self) -> None:
        """Training is over: the module's parameters no longer report their gradients to this learner."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def register(self, config: ProtocolConfig, optimizers: Sequence[Optimizer], stats: Optional[Stats],
                 optimizer_states: Optional[list[dict[str, Any]]] = None) -> None:
        """Learner 0 only: give the server the starting weights and the optimizers to rebuild (on resume, with
        their saved states and statistics)."""
        specs = [OptimizerSpec.from_optimizer(opt, self.params) for opt in optimizers]
        copies = [[t.detach().to(_CPU, copy=True) for t in ts] for ts in (self.params, self.buffers)]
        self.client.register(config, *copies, specs, stats, self.shared_memory, optimizer_states)

    def snapshot(self) -> tuple[list[dict[str, Any]], Stats]:
        """Load the server's weights, and return its optimizer states and statistics of the same clock."""
        self.settle()
        params, buffers, self.client.timestamp, states, stats = self.client.snapshot()
        self.load(params, buffers)
        return states, stats

    def pull(self) -> None:
        self.settle()
        if not self._attached:
            self._attach()
        if self.shm is not None:
            self._read_shared()
        else:
            self.load(*self.client.pull())

    def _attach(self) -> None:
        """Map the server's shared memory if it has some and runs on this host; tell it either way."""
        self._attached = True
        if not self.shared_memory:
            self.client.attached(False)
            return
        names, error = self.client.attach()
        if error is not None and self.client.rank == 0:
            warnings.warn(f"lightning_rudra: {error} Weights and gradients go through RPC instead (slower).")
        if names is not None and names.host == socket.gethostname():
            try:
                self.shm = MappedWeights(names, self.client.rank)
            except RuntimeError:
                self.shm = None  # the same host name, but not the same /dev/shm (another container)
        self.client.attached(self.shm is not None)

    def _read_shared(self) -> None:
        assert self.shm is not None
        self.client.timestamp = self.shm.read(self.load)

    def push(self, index: int, optimizer: Optimizer) -> None:
        """Push the gradient of ``optimizer`` and continue from the weights the server gives back. With
        ``overlap`` (Rudra-adv*), continue at once from the newest weights already received: the reply to this
        push is loaded at the next push, so that communication overlaps the next step's computation."""
        params = self.optimizer_params[index]
        # sparse gradients (nn.Embedding(sparse=True)) travel dense: the server's flat buffers are dense
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.to_dense() if p.grad.is_sparse else p.grad
                 for p in params]
        has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.bool)
        # of the weights this gradient came from (no hook saw it: a gradient set by hand, from the current ones)
        timestamp = self.grad_timestamps[index]
        timestamp = self.client.timestamp if timestamp is None else timestamp
        self.grad_timestamps[index] = None
        if self.shm is not None:
            self.settle()  # the server may still read this buffer for the push in flight
            self.grad_layouts[index].pack_into(grads, self.shm.grads[index])
            packed = None
        else:
            packed = self.grad_layouts[index].pack(grads, _CPU)
        future = self.client.push(index, packed, has_grad, [hyperparameters(g) for g in optimizer.param_groups],
                                  self.buffer_layout.pack(self.buffers, _CPU), timestamp)
        self.settle()
        self._in_flight = (future, index)
        if not self.overlap:
            self.settle()

    def settle(self) -> None:
        """Wait for the push in flight, if any, and load the weights it brought."""
        if self._in_flight is not None:
            (future, index), self._in_flight = self._in_flight, None
            status, staleness, lr_scale, flat_params, flat_buffers = self.client.receive(future)
            if flat_params is None:
                self._read_shared()
            else:
                self.load(flat_params, flat_buffers)
            if self.on_push is not None:
                self.on_push(index, status, staleness, lr_scale)

    def finish(self) -> None:
        """Stop pushing and take the final weights, once every learner has stopped."""
        self.settle()
        flat_params, flat_buffers = self.client.finish()
        if flat_params is None:
            self._read_shared()
        else:
            self.load(flat_params, flat_buffers)

    @torch.no_grad()
    def load(self, flat_params: list[Tensor], flat_buffers: list[Tensor]) -> None:
        """Copy flat weights and buffers (laid out as the server keeps them) into the module."""
        for layout, flats, targets in ((self.param_layout, flat_params, self.params),
                                       (self.buffer_layout, flat_buffers, self.buffers)):
            if targets:
                device = targets[0].device
                torch._foreach_copy_(targets, layout.unpack([f.to(device, non_blocking=True) for f in flats]))


class LearnerOptimizer(Optimizer):
    """``step(closure)`` runs the closure (forward and backward), pushes the gradient and takes back the
    weights the protocol gives. The wrapped optimizer never updates weights itself: its ``param_groups`` stay
    the handle of LR schedulers (their current values travel with every push), and its state lives on the
    server (``state_dict`` fetches it).

    Torch's ``Optimizer.__init__`` is not called: the groups and state are the wrapped optimizer's own.
    """

    def __init__(self, optimizer: Optimizer, index: int, learner: Learner) -> None:
        self.local = optimizer
        self.index = index
        self.learner = learner

    param_groups = property(lambda self: self.local.param_groups)
    state = property(lambda self: self.local.state)
    defaults = property(lambda self: self.local.defaults)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.learner.push(self.index, self.local)
        self.local._opt_called = True  # what torch's LR schedulers check: the server stepped for this optimizer
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.local.zero_grad(set_to_none=set_to_none)
        self.learner.grad_timestamps[self.index] = None

    def state_dict(self) -> dict[str, Any]:
        """The server's state (momentum, moments...) with this learner's parameter groups: their learning rate
        is the one the learner's schedule set, not the server's modulated one."""
        return with_groups(self.learner.client.optimizer_state(self.index), self.local)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this learner's parameter groups and the server's state (learner 0 sends it)."""
        self.load_groups(state_dict)
        if self.learner.client.rank == 0:
            self.learner.client.load_optimizer_state(self.index, state_dict)

    def load_groups(self, state_dict: dict[str, Any]) -> None:
        """Only the hyper-parameters of the parameter groups (where LR schedulers step from)."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.local.param_groups):
            raise ValueError(f"the saved state of optimizer {self.index} has {len(saved)} parameter groups: its "
                             f"optimizer {type(self.local).__name__} has {len(self.local.param_groups)}.")
        for group, values in zip(self.local.param_groups, saved):
            group.update({k: v for k, v in values.items() if k != "params"})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError("parameter groups cannot be added once training under RudraStrategy has started: the "
                           "server built its copy of the optimizer from the groups that existed at setup.")

    def __repr__(self) -> str:
        return f"LearnerOptimizer({self.local!r})"


def with_groups(state: dict[str, Any], optimizer: Optimizer) -> dict[str, Any]:
    """An optimizer state dict from the server (``state``) with the parameter groups of the learner's
    ``optimizer``: what a checkpoint holds."""
    return {"state": state["state"], "param_groups": optimizer.state_dict()["param_groups"]}
