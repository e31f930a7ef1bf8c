"""The benchmarks are code too: the transport job (a push+pull through the real server, with every measure and
the breakdown of one push into its pieces, then through two servers with the learner-side prototype) runs end to end at a small size, so that a
renamed internal breaks a test, not the next benchmark run; the accuracy phase's target, times and ratios are
computed on recorded snapshots (its runs take minutes); the network phase's hosts leave nothing behind, its
bytes per step are counted over the right steps, and a configuration's model size is read from ``--network``."""

import json
import math
import multiprocessing
import os
import shutil
import subprocess
import sys

import pytest
import torch

from benchmarks import accuracy, report, stats
from benchmarks.hosts import two_hosts, why_no_hosts
from benchmarks.targets import check_targets
from lightning_rudra.transport.rpc_world import free_port
from tests.server_processes import still_running


def _transport(rank: int, ports: list[tuple[int, int]], results) -> None:
    """The job with one server, then in the same processes (as the benchmark's long-lived workers run it) with
    two: torch fixes a process's RPC rank at its first init, so the learners' ranks must not depend on it."""
    import torch

    from benchmarks.transport import rudra_transport

    torch.set_num_threads(1)
    for num_servers, (port, gloo_port) in zip((1, 2), ports):
        measures = ("both", "solo", "echo", "gloo", "memcpy", "breakdown") if num_servers == 1 else ("both", "solo")
        # the second pass also runs the learner-side prototype the benchmark lists ("pack into reused buffers")
        patches = ("pack_reuse",) if num_servers == 2 else ()
        results.put(
            (
                num_servers,
                rank,
                rudra_transport(
                    rank,
                    numel=1000,
                    port=port,
                    gloo_port=gloo_port,
                    rounds=1,
                    iters=2,
                    measures=measures,
                    num_servers=num_servers,
                    learner_patches=patches,
                ),
            )
        )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_transport_benchmark_runs_every_measure():
    # not "forkserver": Python's one fork server would start here without the preload that the learners' launcher
    # asks for (Lightning), and every later test's learners would import Lightning themselves (seconds each)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ports = [(free_port(), free_port()) for _ in range(2)]
    workers = [context.Process(target=_transport, args=(rank, ports, results)) for rank in range(2)]
    for worker in workers:
        worker.start()
    try:
        measured = {(servers, rank): out for servers, rank, out in (results.get(timeout=180) for _ in range(4))}
    finally:
        for worker in workers:
            worker.join(timeout=30)
            worker.kill()
    assert [worker.exitcode for worker in workers] == [0, 0]
    expected = {"both", "solo", "echo", "gloo", "memcpy", "clone", "pack", "pack_reuse", "server_update", "load"}
    assert set(measured[1, 0]) == expected and set(measured[2, 0]) == {"both", "solo"}
    assert all(len(times) == 1 and times[0] > 0 for servers in (1, 2) for times in measured[servers, 0].values())


def _run(
    strategy: str,
    seq: int,
    snapshots: list[tuple[float, float]],
    final: tuple[float, float],
    epoch_ends_s: list[list[float]],
    job_wall_s: float = 9.0,
) -> dict:
    """A run as ``Suite._train(..., snapshots=True)`` records it (the fields the phase reads)."""
    return {
        "strategy": strategy,
        "rep": 0,
        "seq": seq,
        "job_wall_s": job_wall_s,
        "samples_per_s": 100.0,
        "accuracy": snapshots,
        "final_accuracy": final,
        "rank0_start_s": 0.1,
        "epoch_ends_s": epoch_ends_s,
        "epoch_times_s": [b - a for a, b in zip(epoch_ends_s[0], epoch_ends_s[0][1:])],
    }


def _config(async_snapshots: list[tuple[float, float]], straggle: str = "sleep") -> dict:
    # DDP's last epoch (rank 0's snapshots after its first epoch end, 1.6 s, and its final weights): mean 0.90 and
    # 0.92; both touch 0.90 early (1.0 s, 0.95) and drop below it before they stay above it
    runs = [
        _run("ddp", 0, [(1.0, 0.95), (2.0, 0.88), (3.0, 0.90)], (3.2, 0.92), [[1.6, 3.1], [1.6, 3.1]], 10.0),
        _run("async", 1, async_snapshots, (2.0, 0.91), [[0.8, 1.6], [0.9, 1.7]], 18.0),
        _run("ddp", 2, [(1.0, 0.6), (2.0, 0.91), (3.0, 0.93)], (3.1, 0.92), [[1.6, 3.0], [1.6, 3.0]], 14.0),
    ]
    return {
        "learners": 2,
        "batch_size": 64,
        "slowdown": 3,
        "straggle": straggle,
        "sleep_ms": 20.0,
        "ideal": 0.5,
        **accuracy.summarize(runs),
    }


def test_accuracy_is_reached_when_it_stays_at_or_above_the_target_not_at_a_lucky_snapshot():
    # touches the target early, drops below it, then stays: from the third point on
    assert stats.stays_from([(1.0, 0.91), (2.0, 0.85), (3.0, 0.92), (4.0, 0.93)], 0.9) == 3.0
    assert stats.stays_from([(1.0, 0.85), (2.0, 0.9)], 0.9) == 2.0  # at the target counts
    # above it all along but the last point (the final weights) below it: never
    assert stats.stays_from([(1.0, 0.91), (2.0, 0.95), (3.0, 0.89)], 0.9) is None
    assert stats.stays_from([], 0.9) is None


def test_the_accuracy_phase_sets_the_target_from_ddps_plateau_and_reads_each_runs_time_to_stay_above_it():
    config = _config([(0.5, 0.6), (1.0, 0.905), (1.5, 0.93)])
    # the plateau: the median of DDP's last-epoch means (0.90, 0.92); the target one point below it
    assert config["ddp_plateau_runs"] == [pytest.approx(0.90), pytest.approx(0.92)]
    assert config["ddp_plateau"] == pytest.approx(0.91) and config["target"] == pytest.approx(0.90)
    assert config["ddp_half_accuracy"] == pytest.approx((0.95 + 0.6) / 2)  # epoch 1 of 2: one snapshot each
    ddp, rudra = config["runs"]["ddp"], config["runs"]["async"]
    # DDP's first snapshot at 1.0 s was above the target, but it did not stay there
    assert ddp["tta_s_reps"] == [3.0, 2.0] and ddp["tta_first_s_runs"] == [1.0, 2.0]
    assert rudra["tta_s"] == 1.0 and rudra["tta_vs_ddp"] == pytest.approx(1.0 / 2.5)  # the DDP runs around it
    assert rudra["best_accuracy"] == 0.93 and rudra["final_accuracy"] == 0.91 and rudra["epochs_trained"] == 2
    # 1.0 s after rank 0's start is 1.1 s on the epochs' clock: 1 epoch (ended at 0.9 s) and 0.2 / 0.8 of the next
    assert rudra["tta_epochs"] == pytest.approx(1.25)
    assert rudra["job_vs_ddp"] == pytest.approx(18.0 / 12.0) and ddp["job_vs_ddp"] == 1.0  # start-up included
    targets = {t["key"]: t for t in check_targets({"accuracy": [config]})}
    assert targets["accuracy_2x3"]["met"] and targets["accuracy_4x3"]["by"] == "not measured"
    assert targets["accuracy_2x3_busy"]["by"] == "not measured"
    assert (
        "| 2 (64) | 3x sleep (20.0) | 0.910 (0.90–0.92) | 0.775 | 0.900 | 2.50 (1.7) | 1.00 (1.2) | 0.40 | 0.500 "
        "| <= 0.6 | 1.50 |" in "\n".join(report._accuracy_table([config], {}))
    )


def test_a_strategy_given_more_epochs_than_ddp_is_read_at_ddps_half_way_and_its_own_end():
    ddp = _run("ddp", 0, [(1.0, 0.95), (2.0, 0.88), (3.0, 0.90)], (3.2, 0.92), [[1.6, 3.1], [1.6, 3.1]], 10.0)
    ends = [[0.5, 1.0, 1.5, 2.0]] * 2  # four epochs against DDP's two
    rudra = _run("async", 1, [(0.3, 0.5), (0.8, 0.7), (1.8, 0.95)], (2.0, 0.93), ends, 12.0)
    runs = accuracy.summarize([ddp, rudra])["runs"]
    assert runs["ddp"]["half_accuracy"] == pytest.approx(0.95) and runs["async"]["half_accuracy"] == 0.5
    assert runs["async"]["epochs_trained"] == 4 and runs["async"]["final_accuracy"] == 0.93


def test_a_row_without_a_straggler_has_its_own_target_async_no_slower_than_ddp():
    config = {**_config([(0.5, 0.6), (1.0, 0.905), (1.5, 0.93)]), "slowdown": 1, "sleep_ms": 0.0, "ideal": 1.0}
    targets = {t["key"]: t for t in check_targets({"accuracy": [config]})}
    assert targets["accuracy_2x1"]["value"] == pytest.approx(0.4) and targets["accuracy_2x1"]["met"]
    assert targets["accuracy_2x3"]["by"] == targets["accuracy_4x1"]["by"] == "not measured"
    assert "| <= 1 |" in "\n".join(report._accuracy_table([config], {}))


def test_an_async_run_that_drops_below_the_target_is_timed_from_when_it_stays_and_a_busy_row_has_its_target():
    config = _config([(0.5, 0.95), (1.0, 0.85), (1.5, 0.92)], straggle="busy")
    rudra = config["runs"]["async"]
    assert rudra["tta_first_s_runs"] == [0.5] and rudra["tta_s"] == 1.5
    assert rudra["tta_vs_ddp"] == pytest.approx(1.5 / 2.5)
    targets = {t["key"]: t for t in check_targets({"accuracy": [config]})}
    assert targets["accuracy_2x3_busy"]["value"] == pytest.approx(0.6)
    assert targets["accuracy_2x3"]["by"] == "not measured"
    assert "| 2 (64) | 3x busy (20.0) |" in "\n".join(report._accuracy_table([config], {}))


def test_an_async_run_that_never_reaches_the_target_is_reported_as_never():
    runs = [
        _run("ddp", 0, [(1.0, 0.9)], (2.0, 0.9), [[1.0, 2.0]]),
        _run("async", 1, [(0.5, 0.6), (1.0, 0.95)], (2.0, 0.85), [[1.0, 2.0]]),  # the final weights below it
        _run("ddp", 2, [(1.0, 0.9)], (2.0, 0.9), [[1.0, 2.0]]),
    ]
    config = {"learners": 2, "batch_size": 64, "slowdown": 3, "sleep_ms": 20.0, **accuracy.summarize(runs)}
    rudra = config["runs"]["async"]
    assert config["target"] == pytest.approx(0.89)
    assert rudra["tta_s"] is None and rudra["tta_vs_ddp"] is None and rudra["tta_reached"] == 0
    assert rudra["best_accuracy"] == 0.95 and rudra["tta_first_s_runs"] == [1.0]
    target = {t["key"]: t for t in check_targets({"accuracy": [config]})}["accuracy_2x3"]
    assert target["met"] is False and target["by"] == "missed: async never reached it"
    assert "| never (–) | never | – | <= 0.6 |" in "\n".join(report._accuracy_table([config], {}))


def _rounds(batchsync_final: float = 0.92) -> dict:
    """A 4-learner row of DDP, async and K-batch-sync as ``--accuracy-strategies async,batchsync`` runs it: each
    Rudra run between DDP runs (``_config``'s), batchsync's with the server's late gradients and batches dealt again."""
    ddp = _config([(0.5, 0.6), (1.0, 0.905), (1.5, 0.93)])  # only to reuse its DDP runs' shapes
    assert ddp["target"] == pytest.approx(0.90)
    batchsync = _run("batchsync", 2, [(0.5, 0.7), (1.0, 0.88), (1.5, 0.91)], (2.2, batchsync_final), [[1.0, 2.0]] * 2)
    batchsync.update(late=30, gradients=150, redealt=28)
    runs = [
        _run("ddp", 0, [(1.0, 0.95), (2.0, 0.88), (3.0, 0.90)], (3.2, 0.92), [[1.6, 3.1], [1.6, 3.1]], 10.0),
        _run("async", 1, [(0.5, 0.6), (1.0, 0.905), (1.5, 0.93)], (2.0, 0.91), [[0.8, 1.6], [0.9, 1.7]], 18.0),
        batchsync,
        _run("ddp", 3, [(1.0, 0.6), (2.0, 0.91), (3.0, 0.93)], (3.1, 0.92), [[1.6, 3.0], [1.6, 3.0]], 14.0),
    ]
    row = {"learners": 4, "batch_size": 32, "slowdown": 3, "straggle": "sleep", "sleep_ms": 20.0, "ideal": 0.4}
    return {**row, **accuracy.summarize(runs)}


def test_two_rudra_strategies_are_each_timed_against_the_ddp_runs_around_them_and_reported_in_a_row_each():
    config = _rounds()
    rudra, ddp = config["runs"]["batchsync"], config["runs"]["ddp"]
    # DDP: stays above 0.90 from 3.0 s (2.0 epochs) and 2.0 s (1 + 0.5 / 1.4 epochs); batchsync from 1.5 s, when
    # it had done 1 + 0.6 / 1.0 epochs (1.5 s after rank 0's start is 1.6 s on the epochs' clock)
    assert rudra["tta_s"] == 1.5 and rudra["tta_vs_ddp"] == pytest.approx(1.5 / 2.5)
    assert rudra["tta_epochs"] == pytest.approx(1.6) and ddp["tta_epochs_runs"] == [2.0, pytest.approx(1 + 0.5 / 1.4)]
    assert rudra["tta_epochs_vs_ddp"] == pytest.approx(1.6 / ((2.0 + 1 + 0.5 / 1.4) / 2))
    assert rudra["late"] == 30 and rudra["late_share"] == pytest.approx(30 / 180) and rudra["redealt"] == 28
    assert rudra["half_accuracy"] == pytest.approx(0.7) and config["ddp_half_accuracy"] == pytest.approx(0.775)
    lines = report._accuracy_table([config], {})
    table = "\n".join(lines)
    assert "| learners (μ) | straggler (delay ms) | strategy | DDP plateau (runs) |" in table
    assert "| Rudra s to target (epochs) | Rudra / DDP (runs) |" in table
    # both strategies, each with its own ratio and target; the shared epoch's ideal is async's only
    assert "| 4 (32) | 3x sleep (20.0) | Rudra async | 0.910 (0.90–0.92) |" in table
    assert "| 1.00 (1.2) | 0.40 | 0.400 | <= 0.6 | 1.50 |" in table
    assert (
        "| Rudra K-batch-sync (K = λ) | 0.910 (0.90–0.92) | 0.775 | 0.900 | 2.50 (1.7) | 1.50 (1.6) | 0.60 | – "
        in table
    )
    assert "| – | <= 0.5 |" in table
    # the second table: epochs to the target against DDP's, accuracy over half the epochs, the late gradients
    assert (
        "| 4 (32) | 3x sleep (20.0) | Rudra K-batch-sync (K = λ) | 1.6 (1.7) | 0.95 | <= 1.1 | 0.700 (0.775) | – "
        "| 30 (0.17) | 28 |" in table
    )
    assert "| Rudra async | 1.2 (1.7) | 0.74 | – | 0.600 (0.775) |" in table  # async's epochs: no target
    targets = {t["key"]: t for t in check_targets({"accuracy": [config]})}
    assert targets["accuracy_batchsync_4x3"]["value"] == pytest.approx(0.6)
    assert targets["accuracy_batchsync_4x3"]["by"] == "missed: 1.20x off"
    assert targets["accuracy_epochs_batchsync_4x3"]["met"] and targets["accuracy_4x3"]["met"]
    never = {t["key"]: t for t in check_targets({"accuracy": [_rounds(batchsync_final=0.85)]})}
    assert never["accuracy_batchsync_4x3"]["by"] == "missed: batchsync never reached it"
    assert never["accuracy_epochs_batchsync_4x3"]["met"] is False


def test_a_straggler_left_behind_in_a_drained_epoch_does_not_hold_its_end_back():
    """As measured under batchsync (4 learners, one 3x): the straggler's gradients all came late, it took its own
    late batch back again and again and ended all its epochs at the run's end; the epochs end with the others'."""
    ranks = [[0.39, 0.76, 1.15, 1.5], [0.37, 0.81, 1.15, 1.5], [0.33, 0.77, 1.31, 1.47], [1.63, 1.63, 1.63, 1.63]]
    assert stats.epoch_ends(ranks) == [0.39, 0.81, 1.31, 1.63]  # the last: the job's end
    run = {"epoch_ends_s": ranks, "rank0_start_s": 0.0}
    assert accuracy.epochs_at(run, 0.6) == pytest.approx(1 + 0.21 / 0.42)
    # async's straggler ends each epoch late, but before the others end the next one: the last learner's end
    assert stats.epoch_ends([[0.8, 1.6], [0.9, 1.7]]) == [0.9, 1.7]


def test_the_accuracy_flags_land_in_the_recorded_config_and_each_rudra_run_has_ddp_runs_around_it(
    tmp_path, monkeypatch, capsys
):
    from benchmarks import provenance, run
    from benchmarks.suite import Suite

    root = tmp_path / "repo"
    root.mkdir()
    monkeypatch.setattr(provenance, "ROOT", _repo(root))
    flags = ["--accuracy-strategies", "async,batchsync,hardsync+backup1", "--accuracy-learners", "4"]
    flags += ["--accuracy-stragglers", "3:sleep,1:busy", "--accuracy-reps", "2", "--accuracy-rudra-epochs", "25"]
    meta = run.main(["--only", "", "--out", str(tmp_path / "out"), *flags])["meta"]
    config = meta["config"]
    assert config["accuracy_strategies"] == ["async", "batchsync", "hardsync+backup1"]
    assert config["accuracy_learners"] == [4] and config["accuracy_reps"] == 2
    assert config["accuracy_epochs"] == 20 and config["accuracy_rudra_epochs"] == 25
    assert config["accuracy_stragglers"] == [(3, "sleep"), (1, "busy")] and config["accuracy_busy_learners"] == [4]
    assert meta["command"].endswith(" ".join(flags))  # the report's command reruns it
    assert run.main(["--only", "", "--out", str(tmp_path / "out")])["meta"]["config"]["accuracy_strategies"] == [
        "async"
    ]
    for bad, message in (
        (["--accuracy-strategies", "async,ddp"], "ddp is not a Rudra strategy"),
        (["--accuracy-stragglers", "3:nap"], "'3:nap' is not K:HOW"),
        (["--accuracy-learners", "four"], "expected numbers"),
        (["--accuracy-rudra-epochs", "10"], "expected at least DDP's 20 epochs"),
    ):
        with pytest.raises(SystemExit):
            run.main(["--only", "", "--out", str(tmp_path / "out"), *bad])
        assert message in capsys.readouterr().err
    order = Suite({"ddp_every": 3}, quick=True)._schedule(["ddp", "async", "batchsync", "hardsync+backup1"], 2)
    assert order[:5] == [("ddp", 0), ("async", 0), ("batchsync", 0), ("hardsync+backup1", 0), ("ddp", 1)]
    assert order[5] == ("batchsync", 1) and order[-1] == ("ddp", 2)  # the strategies take turns going first


class _SweepSuite:
    """What ``accuracy.sweep`` uses of the suite; every job "trains" a rate to a validation accuracy that peaks at
    lr 0.8, 0.01 higher in data order 1 than in order 0."""

    def __init__(self) -> None:
        self.cfg = {"accuracy_epochs": 4, "accuracy_sweep_orders": 2, "accuracy_samples": 3000}
        self.cfg["accuracy_rates"] = [0.025, 0.05, 0.1, 0.2, 0.4]
        self.jobs: list[list[list[tuple[float, int]]]] = []

    def job(self, pool: str, fn: str, timeout: float, tasks: list, **kwargs) -> list:
        assert fn == "benchmarks.training:sweep" and kwargs["batch_size"] == accuracy.BATCH
        self.jobs.append(tasks)
        score = lambda lr, order: 0.9 - 0.1 * abs(math.log2(lr / 0.8)) + 0.01 * order  # noqa: E731
        return [[{"lr": lr, "order": o, "val_accuracy": score(lr, o)} for lr, o in share] for share in tasks]

    def log(self, message: str) -> None:
        pass


def test_ddps_rate_sweep_extends_its_grid_past_an_edge_winner_and_splits_the_work_between_the_workers():
    suite = _SweepSuite()
    chosen = accuracy.sweep(suite, learners=2)
    # 0.4 (the grid's top) won, so 0.8 was added; it won, so 1.6; then 0.8 had a rate on either side
    assert [s["lr"] for s in chosen["scores"]] == [0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6]
    assert chosen["lr"] == 0.8 and not chosen["edge"]
    assert chosen["scores"][5]["val_accuracy"] == pytest.approx(0.905)  # the mean over the 2 data orders
    first = suite.jobs[0]  # 5 rates x 2 orders, one half per worker
    assert sorted(first[0] + first[1]) == sorted((lr, o) for lr in suite.cfg["accuracy_rates"] for o in (0, 1))
    assert len(first[0]) == len(first[1]) == 5
    assert [sorted(job[0] + job[1]) for job in suite.jobs[1:]] == [[(0.8, 0), (0.8, 1)], [(1.6, 0), (1.6, 1)]]
    assert accuracy.past_edge([{"lr": 0.1, "val_accuracy": 0.9}, {"lr": 0.2, "val_accuracy": 0.8}]) == 0.05
    assert accuracy.past_edge([{"lr": 0.1, "val_accuracy": 0.8}, {"lr": 0.2, "val_accuracy": 0.8}]) == 0.05


def test_an_epochs_row_names_its_stragglers_kind_and_prints_the_ideal_and_the_job_ratio_beside_its_ratios():
    runs = [
        {"strategy": "ddp", "seq": 0, "epoch_s": 3.0, "tta_target": 0.4, "tta_s": 6.0, "job_wall_s": 20.0},
        {"strategy": "async", "seq": 1, "epoch_s": 1.8, "tta_target": 0.4, "tta_s": 4.8, "job_wall_s": 30.0},
        {"strategy": "ddp", "seq": 2, "epoch_s": 3.0, "tta_target": 0.4, "tta_s": 6.0, "job_wall_s": 20.0},
    ]
    row = {"learners": 2, "batch_size": 32, "slowdown": 3, "sleep_ms": 24.0, "ideal": 0.5}
    busy = {**row, "straggle": "busy", "runs": stats.summarize_runs(runs)}
    assert busy["runs"]["async"]["job_vs_ddp"] == pytest.approx(1.5)
    table = "\n".join(report._epochs_table([busy], {"target": 0.4}))
    assert "| 2 (32) | 3x busy (24.0) | 3.00 | 1.80 | 0.60 | 0.500 | <= 0.6 |" in table
    assert "| 6.00 | 4.80 | 0.80 | 0.500 | <= 0.7 | 2/2, 1/1 | 1.50 |" in table
    targets = {t["key"]: t for t in check_targets({"epochs": [busy]})}
    assert targets["epochs_2x3_busy"]["value"] == pytest.approx(0.6) and targets["epochs_2x3"]["value"] is None
    old = {**row, "runs": stats.summarize_runs(runs)}  # a results file from before busy-waiting stragglers
    assert {t["key"]: t for t in check_targets({"epochs": [old]})}["epochs_2x3"]["value"] == pytest.approx(0.6)
    assert "| 3x sleep (24.0) |" in "\n".join(report._epochs_table([old], {}))


def test_a_busy_straggler_holds_its_core_where_a_sleeping_one_frees_it():
    """The straggler's delay before a batch, through the job's callback: CPU time of this process, not wall time."""
    import time

    from benchmarks.training import _callback

    spent = {}
    for straggle in ("sleep", "busy"):
        recorder = _callback(1, 0.2, straggle, 0, 10, None, None)
        start = time.process_time()
        recorder.on_train_batch_start(None, None, None, 0)
        spent[straggle] = time.process_time() - start
    assert spent["sleep"] < 0.02 < spent["busy"]


def _left(hosts) -> list[str]:
    """What ``two_hosts`` made that is still here: a namespace, or an end of the link in this (the root) namespace,
    where the link is made before its ends move into the hosts."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10).stdout
    return [host.namespace for host in hosts if host.namespace in namespaces] + [
        host.interface for host in hosts if f" {host.interface}@" in links or f" {host.interface}:" in links
    ]


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.skipif(why_no_hosts(shaped=True) is not None, reason=str(why_no_hosts(shaped=True)))
def test_shaped_hosts_leave_no_namespace_link_queue_or_process_behind_when_the_run_fails(tmp_path):
    """What the network phase runs in: the link shaped on both ends, a process running on a host; an error inside
    (as a failed run, or Ctrl-C) still removes the namespaces, with their ends of the link and queueing disciplines,
    and every process on the hosts."""
    with pytest.raises(RuntimeError, match="the run failed"):
        with two_hosts("1gbit") as hosts:
            assert _left(hosts) == [host.namespace for host in hosts]
            for host in hosts:  # each end of the link, in its host
                assert "tbf" in host.qdisc() and "rate 1Gbit" in host.qdisc()
            started = hosts[1].start(["sleep", "600"], {"PATH": "/usr/bin:/bin"}, tmp_path / "host1.log")
            for _ in range(100):  # bounded: 10 s for the host's first process to start its command
                if len(hosts[1].pids()) >= 3:  # unshare, the host's init, sleep
                    break
                subprocess.run(["sleep", "0.1"], timeout=5)
            assert len(hosts[1].pids()) >= 3
            raise RuntimeError("the run failed")
    assert _left(hosts) == []
    assert started.wait(timeout=10) is not None  # killed with its host
    assert subprocess.run(["pgrep", "-f", f"benchmarks.hosts {hosts[1].namespace}"], timeout=10).returncode == 1


def test_a_shaped_rate_in_tcs_units_or_a_clear_error():
    from benchmarks.hosts import rate_bits

    assert rate_bits("1gbit") == 10**9 and rate_bits("10gbit") == 10**10 and rate_bits("500mbit") == 5 * 10**8
    with pytest.raises(ValueError, match="rate '1gbps': expected a number of gbit"):
        rate_bits("1gbps")


def test_bytes_per_step_count_each_hosts_link_over_every_learners_steps_past_warm_up():
    """Two hosts, two learners each, in step (times 1, 2, ...): host 0's first learner read its link at its batch
    ends; past warm-up (2 batches: every learner's second batch ends at 2.0x) it sent 30 and received 10 per batch."""
    ranks = [
        {"times": [1.0 + k + rank / 100 for k in range(6)], "link": [(30 * k, 10 * k) for k in range(6)]}
        if rank % 2 == 0
        else {"times": [1.0 + k + rank / 100 for k in range(6)], "link": []}
        for rank in range(4)
    ]
    hosts = stats.link_per_step(ranks, 2, warmup=2)
    # host 0's reads past 2.03 s: at 3.00 ... 6.00 (3 steps in between: every learner's batches at 4, 5, 6 / 4)
    assert hosts[0] == {"sent": 30.0, "received": 10.0} and hosts[1] == hosts[0]
    assert stats.link_per_step([{**r, "link": []} for r in ranks], 2, warmup=2) is None


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(why_no_hosts(shaped=True) is not None, reason=str(why_no_hosts(shaped=True)))
def test_the_network_phase_runs_on_two_shaped_hosts_and_counts_the_bytes_on_the_link(tmp_path, monkeypatch):
    """At a small size: the pool's workers on the two hosts, DDP and compressed hardsync each train, every run has
    each host's bytes per step, and no namespace is left."""
    from benchmarks import run

    monkeypatch.setitem(run.QUICK, "network", [{"rate": "1gbit", "learners_per_host": 1, "reps": 1}])
    monkeypatch.setitem(run.QUICK, "network_params", 100_000)
    monkeypatch.setitem(run.QUICK, "network_strategies", ["ddp", "hardsync+bf16"])
    result = run.main(["--quick", "--only", "network", "--out", str(tmp_path)])
    assert result["failures"] == []
    [config] = result["summary"]["network"]
    assert set(config["runs"]) == {"ddp", "hardsync+bf16"} and config["learners_per_host"] == 1
    for entry in config["runs"].values():
        assert entry["samples_per_s"] > 0
        assert all(host["sent"] > 0 and host["received"] > 0 for host in entry["link_per_step"])
    assert '| 1gbit | MLP 0.1 M | 1 (32) | Rudra hardsync, compression="bf16" |' in (tmp_path / "latest.md").read_text()
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    ours = f"rudra{os.getpid() % 100000}h"  # how two_hosts names this process's namespaces (others may run tests)
    assert ours not in namespaces, namespaces


def test_a_network_configuration_names_its_model_size_and_only_10_m_counts_for_the_targets():
    from benchmarks.network import parse_spec

    assert parse_spec("1gbit:1:1:ddp/hardsync:50M") == {
        "rate": "1gbit",
        "learners_per_host": 1,
        "reps": 1,
        "strategies": ["ddp", "hardsync"],
        "params": 50_000_000,
    }
    assert parse_spec("10gbit:2:2:500k")["params"] == 500_000 and "params" not in parse_spec("1gbit:2:2")
    assert parse_spec("1gbit:1:1:ddp/hardsync+buckets:b256")["batch_size"] == 256
    with pytest.raises(ValueError, match="hardsnc is neither a strategy"):
        parse_spec("1gbit:1:1:ddp/hardsnc")
    runs = {"hardsync": {"vs_ddp": 0.8}}
    config = {"rate": "1gbit", "learners_per_host": 2, "runs": runs}  # as committed before the size was a field
    by_key = {t["key"]: t for t in check_targets({"network": [config]})}
    assert by_key["network_aggregation_vs_ddp"]["value"] == 0.8
    by_key = {t["key"]: t for t in check_targets({"network": [{**config, "target_params": 50_000_000}]})}
    assert by_key["network_aggregation_vs_ddp"]["value"] is None
    by_key = {t["key"]: t for t in check_targets({"network": [{**config, "batch_size": 256}]})}
    assert by_key["network_aggregation_vs_ddp"]["value"] is None


def _repo(path) -> str:
    """A git repository with the folders a run's numbers depend on, one commit; returns its root."""
    for name in ("lightning_rudra/core.py", "benchmarks/results/old.md", "docs/notes.md"):
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text("one\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(path)]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "one"]):
        subprocess.run(git + args, check=True, timeout=30)
    return str(path)


def test_a_run_of_modified_code_is_refused_in_the_results_folder_naming_the_files(tmp_path, monkeypatch, capsys):
    """Before anything runs (no phase here): refused where results are published, with the files and what to do;
    the results folder's own files and files outside the code do not count; elsewhere the run writes, marked."""
    from benchmarks import provenance, run

    root = tmp_path / "repo"
    root.mkdir()
    monkeypatch.setattr(provenance, "ROOT", _repo(root))
    results = root / "benchmarks" / "results"
    for name in ("benchmarks/results/old.md", "docs/notes.md"):
        (root / name).write_text("changed\n")
    run.main(["--only", ""])  # neither counts: published
    assert (results / "latest.json").exists()
    (root / "lightning_rudra" / "core.py").write_text("two\n")
    with pytest.raises(SystemExit) as refused:
        run.main(["--only", "", "--name", "again"])
    assert refused.value.code == 2 and not (results / "again.json").exists()
    error = capsys.readouterr().err
    assert "refused" in error and "lightning_rudra/core.py" in error and "docs/notes.md" not in error
    assert "--out DIR" in error and "--allow-modified" in error and "commit" in error
    elsewhere = tmp_path / "elsewhere"
    meta = run.main(["--only", "", "--out", str(elsewhere)])["meta"]
    assert meta["modified"] and meta["modified_files"] == ["lightning_rudra/core.py"]
    assert "-one\n+two" in (elsewhere / "latest.diff").read_text()


def test_untracked_code_a_package_from_another_checkout_and_a_tree_git_cannot_read_count_as_modified(
    tmp_path, monkeypatch
):
    import lightning_rudra
    from benchmarks import provenance

    root = tmp_path / "repo"
    root.mkdir()
    _repo(root)
    assert provenance.tree_state(str(root))["modified_files"] == []
    (root / "examples" / "mnist1d").mkdir(parents=True)
    (root / "examples" / "mnist1d" / "__init__.py").write_text("")  # would shadow a tracked examples/mnist1d.py
    (root / "sitecustomize.py").write_text("")  # runs in every worker
    (root / "notes.txt").write_text("")
    assert provenance.tree_state(str(root))["modified_files"] == ["examples/mnist1d/__init__.py", "sitecustomize.py"]
    (tmp_path / "plain").mkdir()
    assert provenance.tree_state(str(tmp_path / "plain"))["modified_files"] == ["(git could not say)"]
    monkeypatch.setattr(provenance, "CHECKOUT", str(tmp_path / "another"))
    (root / "examples" / "mnist1d" / "__init__.py").unlink()
    (root / "sitecustomize.py").unlink()
    foreign = provenance.tree_state(str(root))["modified_files"]
    assert "lightning_rudra from " + os.path.realpath(lightning_rudra.__file__) in foreign


def test_allow_modified_publishes_marked_with_the_diff_and_a_clean_run_names_the_full_commit(tmp_path, monkeypatch):
    from benchmarks import provenance, run

    root = tmp_path / "repo"
    root.mkdir()
    monkeypatch.setattr(provenance, "ROOT", _repo(root))
    results = root / "benchmarks" / "results"
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    meta = run.main(["--only", "", "--name", "clean"])["meta"]
    assert meta["commit"] == head.strip() and len(meta["commit"]) == 40 and not meta["modified"]
    assert not (results / "clean.diff").exists() and "(modified" not in (results / "clean.md").read_text()
    (root / "lightning_rudra" / "core.py").write_text("two\n")
    meta = run.main(["--only", "", "--name", "dirty", "--allow-modified"])["meta"]
    assert meta["modified"] and "-one\n+two" in (results / "dirty.diff").read_text()
    assert f"{head[:12]} (modified: lightning_rudra/core.py)" in (results / "dirty.md").read_text()


def test_results_of_code_changed_during_the_run_are_not_published(tmp_path, monkeypatch):
    from benchmarks import provenance

    root = tmp_path / "repo"
    root.mkdir()
    monkeypatch.setattr(provenance, "ROOT", _repo(root))
    results = root / "benchmarks" / "results"
    start = provenance.check_tree(str(results), allow_modified=False)
    (root / "docs" / "notes.md").write_text("two\n")  # a commit of docs (or results) meanwhile changes no code
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(root)]
    subprocess.run(git + ["commit", "-qam", "docs"], check=True, timeout=30)
    provenance.write(str(results), "docs", {"meta": {}}, "# docs\n", start)
    assert (results / "docs.json").exists()
    (root / "lightning_rudra" / "core.py").write_text("two\n")
    with pytest.raises(provenance.ModifiedTree, match="changed during the run") as refused:
        provenance.write(str(results), "late", {"meta": {}}, "# late\n", start)
    assert not (results / "late.json").exists()
    kept = str(refused.value).rsplit(" ", 1)[-1]
    assert os.path.exists(os.path.join(kept, "late.json"))
    shutil.rmtree(kept)
    subprocess.run(git + ["commit", "-qam", "code"], check=True, timeout=30)  # committed: no diff, another code
    with pytest.raises(provenance.ModifiedTree, match="changed during the run") as refused:
        provenance.write(str(results), "late", {"meta": {}}, "# late\n", start)
    shutil.rmtree(str(refused.value).rsplit(" ", 1)[-1])
    provenance.write(str(tmp_path / "elsewhere"), "late", {"meta": {}}, "# late\n", start)  # not published: written
    assert (tmp_path / "elsewhere" / "late.json").exists()


def _commit(root, *paths) -> None:
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(root)]
    subprocess.run(git + ["add", *map(str, paths)], check=True, timeout=30)
    subprocess.run(git + ["commit", "-qm", "results"], check=True, timeout=30)


def _results(root, name: str, summary: dict, **meta) -> None:
    """A results file of HEAD's code, committed (the README cites committed results only)."""
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    meta = {"commit": commit.strip(), "modified": False, "command": f"python -m benchmarks.run --name {name}", **meta}
    path = root / "benchmarks" / "results" / f"{name}.json"
    path.write_text(json.dumps({"meta": meta, "summary": summary}))
    _commit(root, path)


def test_the_readmes_table_is_made_from_the_results_files_of_commits_in_the_history(tmp_path, monkeypatch, capsys):
    """Rows from fixture results files, each with its ideal and job ratio, results file, commit and command; rows
    without a results file (or configuration) noted; --check fails until written; refused: a results file of
    modified code, or of a commit not in HEAD's history (nothing written)."""
    from benchmarks import provenance, readme

    root = tmp_path / "repo"
    root.mkdir()
    (root / "README.md").write_text(
        f"# Title\n\nprose\n\n{readme.START}\n| old | table |\n{readme.END}\n\nmore prose\n"
    )
    monkeypatch.setattr(provenance, "ROOT", _repo(root))
    ratio = {"epoch_vs_ddp": 0.63, "epoch_vs_ddp_reps": [0.56, 0.69], "job_vs_ddp": 1.8, "job_vs_ddp_reps": [1.7, 2]}
    epochs = {"learners": 2, "slowdown": 3, "ideal": 0.5, "runs": {"async": ratio}}  # before busy ones: sleeps
    busy = {**epochs, "straggle": "busy", "runs": {"async": {"epoch_vs_ddp": 0.7, "job_vs_ddp": 1.9}}}
    _results(root, "epochs", {"epochs": [busy, epochs], "epochs_info": {}})
    bf16 = {"vs_ddp": 1.1, "vs_ddp_fp16": 0.9, "vs_ddp_fp16_reps": [0.8, 1.0], "job_vs_ddp": 0.95}
    network = {"rate": "1gbit", "learners_per_host": 1, "target_params": 10**7, "server_node": False}
    network["runs"] = {"ddp": {"vs_ddp": 1.0}, "ddp+fp16": {"vs_ddp": 1.2}, "hardsync+bf16": bf16}
    _results(root, "network", {"network": [network]})
    fifty = {**network, "target_params": 5 * 10**7}
    fifty["runs"] = {
        "hardsync": {"vs_ddp": 0.73, "job_vs_ddp": 1.48},
        "hardsync+buckets+8servers": {"vs_ddp": 1.02, "job_vs_ddp": 1.54},
    }
    _results(root, "network-servers-50m", {"network": [fifty]})
    never = {"tta_vs_ddp": None, "tta_s_reps": [None, None], "job_vs_ddp": 1.5}
    calm = [{"learners": 4, "slowdown": 1, "runs": {"async": {"tta_vs_ddp": 1.15, "job_vs_ddp": 1.46}}}]
    _results(root, "accuracy", {"accuracy": [*calm, {"learners": 2, "slowdown": 1, "runs": {"async": never}}]})
    _results(
        root,
        "simulation",
        {
            "simulation": {
                "learners": 30,
                "vs_plain": {"hardsync": 1.13},
                "vs_plain_reps": {"hardsync": [1.1, 1.2, 1.13]},
            }
        },
    )
    assert readme.main(["--check"]) == 1
    assert readme.main([]) == 0 and readme.main(["--check"]) == 0
    text = (root / "README.md").read_text()
    commit = json.loads((root / "benchmarks/results/epochs.json").read_text())["meta"]["commit"]
    assert text.startswith("# Title\n\nprose\n\n") and text.endswith(f"{readme.END}\n\nmore prose\n")
    assert "| old | table |" not in text
    assert (
        "| epoch time, MNIST-1D, 2 learners, one 3× slower | async 0.63× (sleeping), 0.70× (busy-waiting) | 0.50× | "
        f"1.80×, 1.90× | [epochs](benchmarks/results/epochs.md) {commit[:7]} |"
    ) in text
    assert "| DDP fp16 1.20×, hardsync bf16 1.10× (0.90× DDP fp16) | – | –, 0.95× | [network](" in text
    assert "| λ = 30 simulated learners in one process, time / one process | hardsync 1.13× | – | – |" in text
    assert "epoch time, MNIST-1D, 4 learners, one 3× slower (not in `benchmarks/results/epochs.json`)" in text
    assert (
        "| time to DDP's accuracy, no straggler | async 1.15× (4 learners), async never (2 learners) | – | 1.46×, 1.50× |"
        in text
    )
    assert "one 3× slower (not in `benchmarks/results/accuracy.json`)" in text
    assert "2 learners per host, samples/s (not in" in text
    assert (
        "| 2 hosts, 1 Gbit/s, 50 M MLP, 1 learner per host, samples/s | hardsync 0.73×, 4 servers per host, "
        "`bucket_cap_mb=4` 1.02× | – | 1.48×, 1.54× | [network-servers-50m](benchmarks/results/network-servers-50m.md)"
    ) in text

    (root / "README.md").write_text(text.replace("0.63×", "0.60×"))  # edited by hand
    assert readme.main(["--check"]) == 1
    _results(root, "epochs", {"epochs": [epochs]}, modified=True, modified_files=["lightning_rudra/core.py"])
    assert readme.main([]) == 2 and "0.60×" in (root / "README.md").read_text()
    assert "epochs.json was measured on modified code (lightning_rudra/core.py" in capsys.readouterr().err
    _results(root, "epochs", {"epochs": [epochs]}, commit="1" * 40)  # code this repository does not have
    assert readme.main([]) == 2
    assert "which is not in HEAD's history" in capsys.readouterr().err
    (root / "benchmarks/results/epochs.json").write_text("{}")  # the working tree's file is not the one cited
    _results(root, "epochs", {"epochs": [epochs]}, modified=None)  # an old file: not known to be unmodified
    assert readme.main([]) == 2 and "modified code" in capsys.readouterr().err


def test_the_readmes_study_row_counts_the_default_rules_configurations_within_target_on_reported_seeds(
    tmp_path, monkeypatch
):
    """The staleness study's row: per optimizer, the stale configurations whose mean gap to hardsync (same seed;
    the LM's in % of its loss) under the default rule is within the target, and the worst (non-finite: missed,
    the worst); other rules, the tuning seed (and its commit), the sweeps' other rates, cut-short runs and a run's
    earlier rows left out; refused when a run names modified code or the stale runs of one optimizer have several
    rates."""
    from benchmarks import provenance, readme
    from examples.study import staleness as study
    from lightning_rudra.core.compensation import DEFAULT_COMPENSATION

    root = tmp_path / "repo"
    root.mkdir()
    monkeypatch.setattr(provenance, "ROOT", _repo(root))

    def head() -> str:
        return subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()

    sweep_commit = head()  # the tuning seed's runs: not cited
    (root / "docs/notes.md").write_text("two\n")
    _commit(root, root / "docs/notes.md")
    commit = head()
    full = study.STALE_EPOCHS
    rows = []
    # (family, optimizer, λ, hardsync's final measure, the stale runs' final measure per seed)
    cells = [
        ("cnn", "sgd", 4, 0.10, (0.50, 0.11, 0.12)),  # seed 0 cut short (below): +1.5 points, met
        ("cnn", "sgd", 16, 0.10, (0.10, 0.20, 0.30)),  # +10.0: missed
        ("cnn", "sgd", 30, 0.10, (0.10, 0.10, float("nan"))),  # diverged: missed, the worst
        ("lm", "adam", 4, 2.00, (2.03, 2.03, 2.03)),  # +1.5 % (3 points): met
    ]
    for family, optimizer, learners, sync, finals in cells:
        base = dict(family=family, optimizer=optimizer, n=1, lr=0.1, commit=commit, modified=False)
        hardsync = dict(protocol="hardsync", learners=4, rule="none", epochs=study.EPOCHS)
        for seed, final in zip(study.SEEDS, finals):
            rows.append({**base, **hardsync, "seed": seed, "errors": [sync] * study.EPOCHS})
            stale = dict(
                protocol="async", learners=learners, seed=seed, epochs=full, errors=[0.9] * (full - 1) + [final]
            )
            rows.append({**base, **stale, "rule": DEFAULT_COMPENSATION})
            rows.append({**base, **stale, "rule": "none", "errors": [0.9] * full})
        # the tuning seed's runs, and a sweep's other rate on a reported seed: none of them counts
        tuning = {**base, "seed": study.TUNE_SEED, "commit": sweep_commit}
        rows.append({**tuning, **hardsync, "errors": [0.0] * study.EPOCHS})
        rows.append({**tuning, "protocol": "async", "learners": learners, "rule": DEFAULT_COMPENSATION,
                     "epochs": full, "errors": [0.9] * full})  # fmt: skip
        rows.append({**base, **hardsync, "seed": study.SEEDS[0], "lr": 0.4, "errors": [0.9] * study.EPOCHS})
    rows.insert(0, {**rows[1], "errors": [0.1] * full})  # a row of a run trained again later: the later one counts
    rows[2] = {**rows[2], "errors": [0.5] * (full - 1)}  # cut short: left out, so cnn sgd λ = 4 is 2 seeds' mean
    path = root / readme.STUDY
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert readme.study_row()[1] is None  # not committed: not cited
    _commit(root, path)
    what, row, commits = readme.study_row()
    assert row is not None and row[1] == (
        "2 of 4 (sgd 1/3, adam 1/1; worst cnn sgd async λ=30 +inf; mean of 2–3 seeds)"
    ), row
    assert row[2] == "4 of 4" and commits == commit[:7]
    # runs trained at several commits: the row says how many (findings.md names them)
    later = [dict(r, commit=sweep_commit) if r.get("learners") == 16 else r for r in rows]
    path.write_text("".join(json.dumps(r) + "\n" for r in later))
    _commit(root, path)
    assert readme.study_row()[2] == "at 2 commits"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _commit(root, path)
    stray = {**rows[2], "lr": 0.2, "errors": [0.1] * full}
    path.write_text(path.read_text() + json.dumps(stray) + "\n")
    _commit(root, path)
    with pytest.raises(readme.Refused, match="several rates"):
        readme.study_row()
    path.write_text(path.read_text() + json.dumps({**rows[1], "modified": True}) + "\n")
    _commit(root, path)
    with pytest.raises(readme.Refused, match="modified code"):
        readme.study_row()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_with_a_compression_hook_runs_the_hook_on_cpu_and_gloo(monkeypatch):
    """Lightning registers a DDP comm hook on CUDA only: the benchmark's ``ddp+fp16`` must run its hook on CPU (the
    job raises if it never ran), through the pool's workers as the suite runs it."""
    from benchmarks.config import STRATEGIES
    from benchmarks.pool import Pool
    from benchmarks.suite import Suite

    monkeypatch.setenv("PYTHONPATH", os.getcwd())  # the workers import this checkout's benchmarks
    suite = Suite({}, quick=True)
    suite.pools["main"] = Pool("hooktest", size=2, preload=("pytorch_lightning", "benchmarks.training"))
    try:
        suite.pools["main"].start()
        kwargs = dict(mlp_params=20_000, num_learners=2, num_samples=256, max_steps=[4, 4], sleep_s=[0.0, 0.0])
        run = suite._train("ddp+fp16", 0, 0, batch_size=16, warmup=2, **kwargs)
    finally:
        suite.close()
    assert STRATEGIES["ddp+fp16"][3] == {"ddp_comm_hook": "fp16_compress_hook"}
    assert suite.failures == [] and run is not None and run["samples_per_s"] > 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_killed_benchmark_leaves_no_pool_worker_behind():
    """The suite's process killed (SIGKILL: no ``close``, no ``finally``) while its workers wait for a job: they
    see it gone and exit."""
    script = (
        "import os, sys\n"
        "from benchmarks.pool import Pool\n"
        "pool = Pool('orphans', size=2)\n"
        "pool.wait_ready()\n"
        "print(pool.dir, ' '.join(str(p.pid) for p in pool.procs), flush=True)\n"
        "sys.stdin.read()\n"  # until the test kills it
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    folder, *pids = parent.stdout.readline().split()
    workers = [int(pid) for pid in pids]
    try:
        assert len(workers) == 2 and still_running(workers, within=0)
    finally:
        parent.kill()
        parent.wait()
        left = still_running(workers, within=30)
        for pid in left:  # a failure leaves nothing behind either
            os.kill(pid, 9)
        shutil.rmtree(folder, ignore_errors=True)
    assert not left


def test_the_network_profile_says_how_much_of_the_link_time_compute_hid():
    """Issue 34's profile: compute alone, the link's least time for the bytes measured, the step; the share of the
    link time hidden behind compute, and the most that could be."""
    from benchmarks.report import _link_hidden
    from benchmarks.training import compute_s

    config = {"rate": "1gbit", "learners_per_host": 1, "batch_size": 32}
    serial = {"compute_s": 0.05, "samples_per_s": 160}  # a step of 0.4 s: compute and link one after the other
    assert _link_hidden(config, serial, [40.0, 38.0]) == ("0.050 / 0.320 / 0.400", "0% (16%)")
    overlapped = {"compute_s": 0.05, "samples_per_s": 200}  # 0.32 s: all of compute hidden under the link
    assert _link_hidden(config, overlapped, [40.0, 40.0])[1] == "16% (16%)"
    assert _link_hidden(config, {"samples_per_s": 160}, [40.0, 40.0]) == ("–", "–")  # DDP's rows before profiles
    data = {"x": torch.randn(8, 1000), "y": torch.randint(0, 10, (8,))}  # the MLP's inputs and classes
    assert 0 < compute_s(20_000, data, 8, reps=3) < 5
