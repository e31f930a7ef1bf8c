"""RudraStrategy as the Trainer and LightningCLI build it: no process starts here."""

import inspect
import shutil
import tempfile
from datetime import timedelta

import pytest
import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import TorchCheckpointIO
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.cli import LightningCLI
from pytorch_lightning.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

import lightning_rudra
from lightning_rudra import ConfigurationError, LearnerLostError, RudraStrategy
from lightning_rudra.strategy.launchers.learner_errors import LearnerExitedError, errors_folder, kept, record
from lightning_rudra.strategy.checks import warn_of_meetings_per_batch
from tests.lightning_models import Regression


def trainer(strategy, devices=2, **kwargs):
    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False, **kwargs)


@pytest.mark.parametrize(
    "name, protocol",
    [
        ("rudra", "async"),
        ("rudra_hardsync", "hardsync"),
        ("rudra_softsync", "softsync"),
        ("rudra_async", "async"),
        ("rudra_batchsync", "batchsync"),
    ],
)
def test_importing_the_package_registers_the_names(name, protocol):
    strategy = trainer(name).strategy
    assert isinstance(strategy, RudraStrategy) and strategy.protocol == protocol
    assert strategy.num_learners == 2 and strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    assert isinstance(strategy._launcher, _SubprocessScriptLauncher)


def test_defaults_are_the_papers_and_arguments_read_back():
    default = RudraStrategy()
    assert (default.protocol, default.n, default.lr_modulation, default.compensation, default.max_staleness) == (
        "async",
        1,
        "none",
        "momentum+clip+syncnorm+dana",
        None,
    )
    # the paper's modulation alone, as before compensation existed; or both, where they do not overlap
    assert RudraStrategy(lr_modulation="mean").compensation == "none"
    assert (
        RudraStrategy(lr_modulation="mean", compensation="gap").lr_modulation,
        RudraStrategy(compensation="dc").lr_modulation,
    ) == ("mean", "none")
    strategy = RudraStrategy(
        protocol="softsync",
        n=2,
        lr_modulation="per_gradient",
        max_staleness=4,
        nonfinite="raise",
        rpc_timeout=30,
        start_method="forkserver",
        overlap=True,
        bucket_cap_mb=4,
    )
    assert (default.bucket_cap_mb, strategy.bucket_cap_mb) == (None, 4.0)
    assert (
        strategy.protocol,
        strategy.n,
        strategy.lr_modulation,
        strategy.max_staleness,
        strategy.nonfinite,
        strategy.rpc_timeout,
        strategy.start_method,
        strategy.overlap,
    ) == ("softsync", 2, "per_gradient", 4, "raise", 30.0, "forkserver", True)
    launcher = trainer(strategy).strategy._launcher
    assert isinstance(launcher, _MultiProcessingLauncher) and launcher._start_method == "forkserver"
    assert (default.sampling, default.shared_memory) == ("shared", True)
    assert RudraStrategy(protocol="hardsync").sampling == "static"
    assert RudraStrategy(sampling="static", shared_memory=False).sampling == "static"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(protocol="bsp"), "protocol='bsp' is not supported: expected one of 'hardsync', 'softsync', 'async'"),
        (dict(n=0), "n=0 is not valid"),
        (dict(lr_modulation="linear"), "lr_modulation='linear'"),
        (
            dict(compensation="momentum+adam"),
            r"compensation='momentum\+adam' is not supported: expected 'none' or one or more",
        ),
        (dict(compensation="none+dc"), r"compensation='none\+dc'"),
        (dict(lr_modulation="mean", compensation="momentum"), "lr_modulation='mean' and compensation='momentum' both"),
        (dict(max_staleness=-2), "max_staleness=-2"),
        (dict(start_method="fork"), "start_method='fork'"),
        (dict(rpc_timeout=0), "rpc_timeout=0"),
        (dict(protocol="hardsync", overlap=True), "overlap=True is not available with protocol='hardsync'"),
        (dict(sampling="dynamic"), "sampling='dynamic' is not supported: expected 'shared', 'static' or None"),
        (dict(protocol="hardsync", sampling="shared"), "sampling='shared' is not available with protocol='hardsync'"),
        (dict(node_aggregation=True), "node_aggregation=True cannot be used with protocol='async'"),
        (dict(protocol="softsync", node_aggregation=True), "cannot be used with protocol='softsync'"),
        # the default protocol was 1-softsync: n alone must not silently become async's
        (dict(n=2), "n=2 is softsync's splitting parameter, and protocol='async' has none. For 2-softsync, pass"),
        (dict(protocol="hardsync", node_aggregation=True, min_learners=1), "cannot be used with min_learners=1"),
        (dict(protocol="hardsync", node_aggregation=True, simulate=2), "cannot be used with simulate=2"),
        (dict(node_aggregation="yes"), "node_aggregation='yes' is not valid"),
        (dict(on_stale="wait"), "on_stale='wait' is not supported: expected one of 'drop', 'block'"),
        (dict(on_stale="block"), "on_stale='block' needs a bound to keep: max_staleness=None"),
        (dict(protocol="hardsync", max_staleness=0, on_stale="block"), "nothing to block under protocol='hardsync'"),
        (dict(protocol="async", max_staleness=3, on_stale="block", overlap=True), "not available with overlap=True"),
        (dict(protocol="async", max_staleness=3, on_stale="block", simulate=2), "cannot be simulated \\(simulate=2\\)"),
        (dict(bucket_cap_mb=0), "bucket_cap_mb=0 is not valid: expected a size in MiB > 0"),
        (dict(bucket_cap_mb="4"), "bucket_cap_mb='4' is not valid"),
        (dict(bucket_cap_mb=True), "bucket_cap_mb=True is not valid"),
        (dict(bucket_cap_mb=float("inf")), "bucket_cap_mb=inf is not valid"),
        (dict(bucket_cap_mb=4, simulate=2), "bucket_cap_mb=4 is not available with simulate"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message) as refused:
        RudraStrategy(**kwargs)
    assert isinstance(refused.value, ConfigurationError)


@pytest.mark.parametrize(
    "kwargs, nodes, devices, expected",
    [
        (dict(protocol="hardsync"), 2, 2, True),  # where the learners then decide, server by server
        (dict(protocol="hardsync"), 1, 2, False),  # one host: shared memory already
        (dict(protocol="hardsync"), 2, 1, False),  # one learner per node: nothing to sum
        (dict(protocol="async"), 2, 2, False),
        (dict(protocol="hardsync", min_learners=2), 2, 2, False),
        (dict(protocol="hardsync", node_aggregation=False), 2, 2, False),
        (dict(protocol="hardsync", node_aggregation=True), 1, 2, True),
    ],
)
def test_node_aggregation_is_on_by_default_only_under_hardsync_with_several_nodes_of_several_learners(
    kwargs, nodes, devices, expected
):
    strategy = RudraStrategy(**kwargs)
    trainer(strategy, devices=devices, num_nodes=nodes)
    assert strategy._aggregating is expected


def test_n_larger_than_the_learners_is_refused_when_the_trainer_is_built():
    with pytest.raises(ValueError, match="n=3 is larger than the number of learners λ=2") as refused:
        trainer(RudraStrategy(protocol="softsync", n=3))
    assert isinstance(refused.value, ConfigurationError)
    trainer(RudraStrategy(protocol="async", n=1))  # n = 1 (the default) is every protocol's


def test_on_stale_defaults_to_drop_reads_back_and_a_bound_too_small_for_the_learners_is_refused():
    assert RudraStrategy().on_stale == "drop" and RudraStrategy(max_staleness=1).on_stale == "drop"
    strategy = RudraStrategy(protocol="async", max_staleness=1, on_stale="block")
    assert (strategy.on_stale, strategy._options.protocol_config(2).on_stale) == ("block", "block")
    trainer(strategy)  # λ = 2: async needs max_staleness >= 1
    with pytest.raises(
        ValueError, match="max_staleness=1 with on_stale='block' cannot be kept by async with λ=3"
    ) as refused:
        trainer(RudraStrategy(protocol="async", max_staleness=1, on_stale="block"), devices=3)
    assert isinstance(refused.value, ConfigurationError) and "Use max_staleness >= 2" in str(refused.value)
    assert "protocol='softsync' (1-softsync needs max_staleness >= 1)" in str(refused.value)  # async has no n
    with pytest.raises(ValueError, match="fewer learners, a smaller n, or on_stale='drop'"):
        trainer(RudraStrategy(protocol="softsync", n=2, max_staleness=1, on_stale="block"), devices=3)


@pytest.mark.parametrize("protocol", ["hardsync", "softsync", "async", "batchsync"])
def test_one_learner_is_valid_for_every_protocol(protocol):
    assert trainer(RudraStrategy(protocol=protocol), devices=1).strategy.num_learners == 1


def test_lightning_cli_reads_the_strategy_from_yaml(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 3\n  logger: false\n  strategy:\n"
        "    class_path: lightning_rudra.RudraStrategy\n"
        "    init_args:\n      protocol: softsync\n      n: 3\n      lr_modulation: per_gradient\n      max_staleness: 5\n"
        "      on_stale: block\n      bucket_cap_mb: 2.5\n"
    )
    cli = LightningCLI(Regression, run=False, args=["--config", str(config)])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, RudraStrategy)
    assert (strategy.protocol, strategy.n, strategy.lr_modulation, strategy.max_staleness) == (
        "softsync",
        3,
        "per_gradient",
        5,
    )
    assert strategy.num_learners == 3 and strategy.on_stale == "block" and strategy.bucket_cap_mb == 2.5


def test_lightning_cli_reads_k_batch_sync_and_backup_learners_from_yaml(tmp_path):
    for init_args, expected in (
        ("protocol: batchsync\n      k: 6", ("batchsync", 6, 0, "shared")),
        ("protocol: hardsync\n      backup: 1", ("hardsync", None, 1, "shared")),
    ):
        config = tmp_path / "config.yaml"
        config.write_text(
            "trainer:\n  accelerator: cpu\n  devices: 3\n  logger: false\n  strategy:\n"
            f"    class_path: lightning_rudra.RudraStrategy\n    init_args:\n      {init_args}\n"
        )
        strategy = LightningCLI(Regression, run=False, args=["--config", str(config)]).trainer.strategy
        assert (strategy.protocol, strategy.k, strategy.backup, strategy.sampling) == expected
        config_of_server = strategy._options.protocol_config(strategy.num_learners)
        assert (config_of_server.k, config_of_server.backup, config_of_server.discards_late) == expected[1:3] + (True,)


def test_lightning_cli_takes_a_registered_name_on_the_command_line():
    cli = LightningCLI(
        Regression,
        run=False,
        args=[
            "--trainer.accelerator=cpu",
            "--trainer.devices=2",
            "--trainer.strategy=rudra_hardsync",
            "--trainer.logger=false",
        ],
    )
    assert isinstance(cli.trainer.strategy, RudraStrategy) and cli.trainer.strategy.protocol == "hardsync"
    # the config LightningCLI saves beside the logs (its SaveConfigCallback writes this dump) records the name
    assert "strategy: rudra_hardsync" in cli.parser.dump(cli.config, skip_none=False)


def test_the_package_exports_its_public_api():
    assert {"RudraStrategy", "Stats"} <= set(lightning_rudra.__all__)


@pytest.mark.parametrize(
    "kwargs, callbacks, message",
    [
        (dict(max_time={"minutes": 5}), [], r"Trainer\(max_time=300 s\)"),
        ({}, [ModelCheckpoint(train_time_interval=timedelta(minutes=1))], r"train_time_interval=0:01:00"),
    ],
)
def test_features_that_meet_after_every_batch_are_warned_of_under_static_shards(kwargs, callbacks, message):
    built = trainer(RudraStrategy(protocol="async", sampling="static"), callbacks=callbacks, **kwargs)
    with pytest.warns(UserWarning, match=message + ".*every batch becomes a meeting"):
        warn_of_meetings_per_batch(built)


def test_a_checkpoint_write_that_fails_leaves_the_previous_one(tmp_path):
    class BreaksHalfway(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            with open(path, "wb") as file:
                file.write(b"half a checkpoint")
            raise OSError("No space left on device (made up)")

    strategy = RudraStrategy(checkpoint_io=TorchCheckpointIO())
    path = tmp_path / "last.ckpt"
    strategy.save_checkpoint({"state": 1}, path)
    strategy.checkpoint_io = BreaksHalfway()
    with pytest.raises(OSError, match="made up"):
        strategy.save_checkpoint({"state": 2}, path)
    assert torch.load(path)["state"] == 1 and [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_under_spawn_a_killed_learner_reaches_fit_as_a_lost_learner_and_still_as_torchs_exception():
    with pytest.raises(LearnerLostError, match="^process 1 terminated with signal SIGKILL$") as lost:
        with kept(errors_folder()):
            raise ProcessExitedException("process 1 terminated with signal SIGKILL", 1, 123, -9, "SIGKILL")
    assert type(lost.value) is LearnerExitedError and isinstance(lost.value, ProcessExitedException)
    assert (lost.value.error_index, lost.value.exit_code, lost.value.signal_name) == (1, -9, "SIGKILL")


def test_under_spawn_a_learners_error_reaches_fit_with_its_class_and_torchs_message():
    folder, message = errors_folder(), "\n\n-- Process 1 terminated with the following error:\nTraceback ..."
    record(folder, 1, ConfigurationError("n=3 is larger"))  # in learner 1
    with pytest.raises(ConfigurationError) as refused:
        with kept(folder):
            raise ProcessRaisedException(message, 1, 123)
    assert str(refused.value) == message and isinstance(refused.value.__cause__, ProcessRaisedException)
    with pytest.raises(ProcessRaisedException):  # an error of another kind: torch's, as Lightning's launcher has it
        with kept(errors_folder()):
            raise ProcessRaisedException(message, 0, 123)


def test_a_learners_error_stays_its_own_when_the_folder_is_gone_and_no_folder_outlives_a_failed_start(
    monkeypatch, tmp_path
):
    folder = errors_folder()
    shutil.rmtree(folder)
    record(folder, 1, ConfigurationError("n=3 is larger"))  # the launcher ended first: nothing to record, no error
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where errors_folder makes its folders

    def cannot_start(*args, **kwargs):
        raise OSError("no more processes")

    monkeypatch.setattr(torch.multiprocessing, "start_processes", cannot_start)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=RudraStrategy(start_method="spawn"), logger=False)
    with pytest.raises(OSError, match="no more processes"):
        trainer.strategy.launcher.launch(lambda: None, trainer=trainer)
    assert list(tmp_path.iterdir()) == []


def test_the_arguments_read_back_but_cannot_be_changed_once_the_strategy_is_built():
    strategy = RudraStrategy(protocol="softsync", n=2)
    with pytest.raises(AttributeError, match=r"RudraStrategy.protocol cannot be changed once the strategy is built"):
        strategy.protocol = "async"
    assert (strategy.protocol, strategy.n) == ("softsync", 2)
    plugins = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}
    for name in set(inspect.signature(RudraStrategy).parameters) - plugins:  # every one of its own
        value = getattr(strategy, name)
        with pytest.raises(AttributeError, match=rf"RudraStrategy.{name} cannot be changed"):
            setattr(strategy, name, value)
        with pytest.raises(AttributeError, match=rf"RudraStrategy.{name} cannot be deleted"):
            delattr(strategy, name)
