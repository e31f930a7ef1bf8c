"""The compensation study: its rate grid's extension, its equal-time cut (fast, no training), and a tiny
grid trained and reported."""

import pytest

import examples.study.compensation as study
import examples.study.families as families
from lightning_rudra.timing import Jittered, push_order


def test_a_rate_grid_grows_one_step_past_the_edge_its_best_is_on_until_the_best_is_interior():
    assert study.next_rate({0.001: 0.3, 0.003: 0.2, 0.01: 0.1}) == 0.0333
    assert study.next_rate({0.05: 0.1, 0.1: 0.2, 0.2: 0.3}) == 0.025
    assert study.next_rate({0.05: 0.2, 0.1: 0.1, 0.2: 0.3}) is None
    assert study.next_rate({0.05: 0.2, 0.1: 0.2, 0.2: 0.2}) == 0.025  # a tie goes to the smaller rate: an edge

    truth = lambda lr: abs(lr - 0.1)  # noqa: E731  best at 0.1, two steps past the first grid

    def get(run):
        assert run["seed"] == study.TUNE_SEED, "a choice made on a reported seed"
        if run["protocol"] == "hardsync":
            return {"val_errors": [truth(run["lr"])] * study.LAST}
        return {"val_errors": [0.5 if run["rule"] == "paper" else 0.2] * study.LAST}

    chosen = study.choose(get, study.GRIDS["reduced"])
    assert chosen["adam"]["rate"] == 0.111 and chosen["adam"]["interior"] and chosen["adam"]["rule"] == "momentum"
    assert sorted(chosen["adam"]["rates"]) == [0.001, 0.003, 0.01, 0.0333, 0.111, 0.37]


def test_hardsync_waits_for_the_slowest_step_of_each_round_and_async_for_no_one():
    timing, steps = Jittered(0.3, seed=5), [3, 3, 2]
    durations = [[timing.duration(r, 10 + k) for k in range(s)] for r, s in enumerate(steps)]
    rounds = [max(d[k] for d in durations if len(d) > k) for k in range(3)]
    assert study.epoch_time("hardsync", steps, timing, [10] * 3) == pytest.approx(sum(rounds))
    assert study.epoch_time("async", steps, timing, [10] * 3) == pytest.approx(max(map(sum, durations)))
    assert study.epoch_time("softsync", steps, timing, [10] * 3) == study.epoch_time("async", steps, timing, [10] * 3)
    # the same model push_order orders by: async's last push ends when the longest learner's steps are done
    assert push_order("async", steps, timing, [10] * 3)[-1] == max(range(3), key=lambda r: sum(durations[r]))
    # without jitter nobody waits, with it hardsync is slower every epoch
    even = study.simulated_times("hardsync", 4, 3, 0, 1000)
    assert study.learner_steps(1000, 4) == [7, 7, 7, 7] and study.simulated_times("async", 4, 3, 0, 1000)[-1] < even[-1]


def test_the_equal_time_cut_is_the_last_epoch_finished_by_hardsyncs_end():
    assert study.equal_time_epochs([1.0, 2.0, 3.0, 4.0], 3.0) == 3
    assert study.equal_time_epochs([1.0, 2.0, 3.0, 4.0], 2.9) == 2
    assert study.equal_time_epochs([1.0, 2.0], 0.5) == 0
    from examples.study.compensation_report import compare

    budget = study.simulated_times("hardsync", 4, 2, 0, 1000)[-1]  # 2 epochs of 7 rounds, each 1 or longer
    assert 14 < budget < 21
    times = [0.4 * budget, 0.8 * budget, 1.2 * budget, 1.6 * budget]  # the stale run's: 2 epochs by then
    stale = dict(learners=4, seed=0, train_samples=1000, errors=[0.5, 0.4, 0.3, 0.2], times=times)
    cmp = compare(stale, dict(errors=[0.3, 0.25]), 2)
    assert (cmp["epochs_error"], cmp["time_epochs"], cmp["time_error"], cmp["end_error"]) == (0.4, 2, 0.4, 0.2)
    assert cmp["epochs_gap"] == pytest.approx(15) and cmp["end_gap"] == pytest.approx(-5)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tiny_grid_tunes_on_seed_100_trains_the_reported_seeds_and_reports(tmp_path, monkeypatch):
    tiny = study.Grid(1, (("async", 2, 1), ("softsync", 4, 1)), ("momentum", "paper"), (("async", 2, 1),), ())
    for name, value in dict(SEEDS=(0,), RATES={"sgd": (0.05, 0.1)}, GRIDS={"reduced": tiny}, MAX_EXTENSIONS=1).items():
        monkeypatch.setattr(study, name, value)
    monkeypatch.setattr(families, "NUM_SAMPLES", 200)
    study.main(["--out", str(tmp_path), "--grid", "reduced"])
    rows = study.read_rows(tmp_path / "runs.jsonl")
    tuning = [r for r in rows if r["seed"] == study.TUNE_SEED]
    assert {r["seed"] for r in rows} == {0, study.TUNE_SEED}
    assert len([r for r in tuning if r["protocol"] == "hardsync"]) == 3  # the two rates and one extension
    assert {r["rule"] for r in tuning if r["protocol"] != "hardsync"} == {"momentum", "paper"}
    assert all(len(r["errors"]) == len(r["val_errors"]) == len(r["times"]) == r["epochs"] for r in rows)
    findings = (tmp_path / "findings.md").read_text()
    assert "| sgd | momentum (default) | async | 2 | 1 |" in findings and "| 1-softsync | 4 |" in findings
    assert (tmp_path / "compensation.png").stat().st_size > 0
    study.main(["--out", str(tmp_path), "--grid", "reduced", "--resume"])  # nothing left to train
    assert len(study.read_rows(tmp_path / "runs.jsonl")) == len(rows)
    study.main(["--out", str(tmp_path), "--grid", "reduced", "--report-only"])
    assert (tmp_path / "findings.md").read_text() == findings
