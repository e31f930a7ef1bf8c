"""``start_method="spawn"`` or ``"forkserver"``: Lightning's multiprocessing launcher, bringing back what the calling
process needs."""

import multiprocessing
import os
import tempfile
from typing import TYPE_CHECKING, Any, Callable, Optional

import pytorch_lightning as pl
import torch
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import _wrap
from lightning_fabric.strategies.launchers.multiprocessing import _check_bad_cuda_fork, _check_missing_main_guard
from pytorch_lightning.strategies.launchers import _MultiProcessingLauncher
from pytorch_lightning.strategies.launchers.multiprocessing import _GlobalStateSnapshot, _WorkerOutput
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities import rank_zero_warn
from torchmetrics import Metric

from lightning_rudra.server.forked_server import STARTER_ENV
from lightning_rudra.server.starter import SERVER_STARTER
from lightning_rudra.strategy.launchers.learner_errors import errors_folder, forget, kept, record, recorded
from lightning_rudra.strategy.launchers.popen import Restarts, check_learner_zero, join_survivors
from lightning_rudra.core.stats import Stats

if TYPE_CHECKING:  # rudra.py imports this module
    from lightning_rudra.strategy.rudra import RudraStrategy

_COMPILED = "_orig_mod."  # what torch.compile's wrapper adds to the names of the module it compiles


def _lost(outputs: list[_WorkerOutput], return_queue: Any) -> list[int]:
    """Learner 0 has ended well: its output (kept in ``outputs``) names the learners the server lost."""
    outputs.append(return_queue.get())
    stats = outputs[0].extra.get("rudra_stats")
    return sorted(int(rank) for rank in stats["lost"]) if stats else []


def _own_copies(module: torch.nn.Module) -> None:
    """torch's multiprocessing pickler hands a started process the caller's CPU tensors in shared memory: every
    learner would read and write the same parameters, buffers and torchmetrics states (one learner loading the
    server's weights under another's step, metric states summed over all learners before their sync). Each
    learner takes its own copy."""
    for part in module.modules():
        for tensors in (part._parameters, part._buffers):
            for tensor in tensors.values():
                if tensor is not None and tensor.is_shared():
                    tensor.data = tensor.data.clone()
        if isinstance(part, Metric):
            for name in part._defaults:
                value = getattr(part, name)
                if isinstance(value, torch.Tensor) and value.is_shared():
                    setattr(part, name, value.clone())
                elif isinstance(value, list):
                    setattr(part, name, [v.clone() if v.is_shared() else v for v in value])


class SpawnLauncher(_MultiProcessingLauncher):
    """Brings the server's statistics back to the process that called ``fit``, with learner 0's weights, also
    when ``configure_model`` compiled parts of the module (Lightning loads them by name, and without this the
    compiled parts' names would not match and their trained weights would be silently dropped).

    With ``"forkserver"``, Python's fork server (one per calling process, ending with it) imports Lightning and
    this package once, and every learner of every later ``fit`` is forked from it, and every server process from
    a server starter forked from it (:mod:`~lightning_rudra.server.starter`): seconds saved per process.
    Lightning hands spawned processes the caller's random and deterministic state but not forked ones, and a
    fork server's children have the environment of when it started: both are brought here as spawn has them.
    With ``min_learners``, a learner that fails (learner 0 too) does not end the others
    (:func:`~lightning_rudra.strategy.launchers.popen.join_survivors`).
    """

    _strategy: "RudraStrategy"  # Lightning's launcher takes any ParallelStrategy; launcher_for passes ours
    _errors: Optional[str] = None  # where this launch's learners record their errors' classes (learner_errors.py)

    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        """Lightning's launch, but for what the fork server needs and, with ``min_learners``, for how the learners
        are joined (:func:`~lightning_rudra.strategy.launchers.popen.join_survivors`)."""
        if self._start_method == "forkserver":
            _check_bad_cuda_fork()
            # only read when the fork server starts (the first launch); "__main__" is Python's own default
            multiprocessing.set_forkserver_preload(["__main__", pl.__name__, __name__.rsplit(".", 2)[0]])
        else:
            _check_missing_main_guard()
        if self._already_fit and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            raise NotImplementedError(
                "Calling `trainer.fit()` twice on the same Trainer instance using a spawn-based "
                "strategy is not supported: create a new Trainer and pass `fit(ckpt_path=...)`."
            )
        assert self._strategy.cluster_environment is not None
        os.environ["MASTER_PORT"] = str(self._strategy.cluster_environment.main_port)  # one port for every rank
        self._environ = dict(os.environ)
        if self._start_method == "forkserver":  # the learners' server processes are forked too
            try:
                self._environ[STARTER_ENV] = SERVER_STARTER.ensure_running()
            except (OSError, RuntimeError) as error:  # slower, not wrong: fresh interpreters, as under spawn
                rank_zero_warn(f"lightning_rudra: {error}; the server processes start as fresh interpreters.")
        global_states = _GlobalStateSnapshot.capture()  # forkserver's too: Lightning's launch captures spawn's only
        return_queue = mp.get_context(self._start_method).SimpleQueue()
        process_args = (trainer, function, args, kwargs, return_queue, global_states)
        self._errors = errors = errors_folder()  # where a learner that fails records the class of its error
        try:
            context = mp.start_processes(
                self._wrapping_function,
                nprocs=self._strategy.num_processes,
                join=False,
                args=process_args,
                start_method=self._start_method,
            )
        except BaseException:
            with kept(self._errors):  # removes the folder: no learner will record in it
                raise
        self.procs = context.processes
        outputs: list[_WorkerOutput] = []
        min_learners = self._strategy.min_learners
        if min_learners is None:
            # once one fails: 5 s for the others to end on their own (the server tells them), then SIGTERM, 5 s,
            # SIGKILL (torch's default waits 30 s, which a stopped process always takes)
            with kept(self._errors):  # torch's exception for a learner's failure, raised as the package's error
                while not context.join(grace_period=5):
                    pass
        else:
            restarts = Restarts(self._strategy.max_restarts)
            with kept(self._errors):
                join_survivors(
                    context,
                    min_learners,
                    lambda: _lost(outputs, return_queue),
                    grace=self._strategy.rpc_timeout + 10,
                    restarts=restarts,
                    restart=lambda index: self._restart(context, index, process_args),
                )
                check_learner_zero(context, restarts, recorded(errors, 0))
        worker_output = outputs[0] if outputs else return_queue.get()
        if trainer is None:
            return worker_output
        self._already_fit |= trainer.state.fn == TrainerFn.FITTING
        self._recover_results_in_main_process(worker_output, trainer)
        return worker_output.trainer_results

    def _restart(self, context: Any, index: int, args: tuple) -> None:
        """Start learner ``index`` again, as torch's ``start_processes`` started it (its error file included)."""
        forget(self._errors, index)
        error_file = tempfile.NamedTemporaryFile(prefix="pytorch-errorfile-", suffix=".pickle", delete=False)
        error_file.close()
        os.unlink(error_file.name)
        context_of_method: Any = mp.get_context(self._start_method)  # a spawn or forkserver context: it has Process
        process = context_of_method.Process(
            target=_wrap, args=(self._wrapping_function, index, args, error_file.name), daemon=False
        )
        process.start()
        context.processes[index] = process
        context.error_files[index] = error_file.name
        context.sentinels[process.sentinel] = index

    def _wrapping_function(  # 7 params: Lightning's _MultiProcessingLauncher._wrapping_function, overridden
        self,
        process_idx: int,
        trainer: Optional["pl.Trainer"],
        function: Callable,
        args: Any,
        kwargs: Any,
        return_queue: Any,
        global_states: Optional[_GlobalStateSnapshot] = None,
    ) -> None:
        os.environ.clear()  # a fork server's child has the environment of when the fork server started
        os.environ.update(self._environ)
        for module in (arg for arg in args if isinstance(arg, torch.nn.Module)):
            _own_copies(module)
        try:
            super()._wrapping_function(process_idx, trainer, function, args, kwargs, return_queue, global_states)
        except BaseException as exception:
            # Lightning tears a failed stage down in the calling process only: here the learner leaves its run,
            # saying why, instead of going silent
            self._strategy.on_exception(exception)
            self._strategy.teardown()
            record(self._errors, process_idx, exception)
            raise

    def get_extra_results(self, trainer: "pl.Trainer") -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        stats = self._strategy.stats
        extra["rudra_stats"] = stats.to_dict() if stats is not None else None
        return extra

    def update_main_process_results(self, trainer: "pl.Trainer", extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        if extra.get("rudra_stats") is not None:
            self._strategy.stats = Stats.from_dict(extra["rudra_stats"])

    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: "pl.Trainer") -> None:
        if worker_output.weights_path is not None:
            io = self._strategy.checkpoint_io
            weights = io.load_checkpoint(worker_output.weights_path)
            ours = trainer.lightning_module.state_dict()
            renamed = {name if name in ours else name.replace(_COMPILED, ""): value for name, value in weights.items()}
            lost = sorted(set(renamed) - set(ours))
            if lost:
                rank_zero_warn(
                    f"{len(lost)} trained tensors of learner 0 ({', '.join(lost[:3])}"
                    f"{', ...' if len(lost) > 3 else ''}) have no place in the module of this process: "
                    "configure_model changed the module's composition in the learners. They were not "
                    "returned; use start_method='popen' (the default), or load them from a checkpoint."
                )
            io.save_checkpoint(renamed, worker_output.weights_path)
        super()._recover_results_in_main_process(worker_output, trainer)
