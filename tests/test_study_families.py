"""The model families of the in-process studies (their splits, the language's entropy floor) and the staleness-rule
study on a tiny grid, trained and reported."""

import json
import math

import pytest
import torch

import examples.language_model as language
import examples.study.families as families
import examples.study.staleness as study
from examples.study.compensation import read_rows


@pytest.mark.parametrize("splits", [lambda seed: families.mnist1d_splits(seed, 200), language.language_splits])
def test_each_seed_has_its_own_sample_and_validation_is_held_out_of_training_and_disjoint_from_test(splits):
    data = splits(0)
    (x, _), (x_val, _), (x_test, _) = data["train"], data["val"], data["test"]
    assert len(x_val) == int((len(x) + len(x_val)) * families.VAL_FRACTION) > 0 and len(x_test) > 0
    rows = lambda t: {tuple(v.tolist()) for v in t}  # noqa: E731
    assert not rows(x_val) & rows(x_test) and not rows(x_val) & rows(x) and not rows(x) & rows(x_test)
    assert not torch.equal(splits(1)["test"][0], x_test)  # another seed, another sample


def test_the_language_is_predictable_below_uniform_and_its_floor_is_the_chains_entropy_rate():
    matrix = language.transitions(0)
    assert torch.allclose(matrix.sum(1), torch.ones(language.VOCAB))
    floor = language.entropy_rate(0)
    assert 0.5 < floor < math.log(language.VOCAB) - 0.5
    # the true chain's own predictions score the floor on its sequences, up to the sample's noise
    x, y = language.language_splits(0)["test"]
    true_loss = -matrix[x.reshape(-1), y.reshape(-1)].log().mean().item()
    assert true_loss == pytest.approx(floor, rel=0.03)
    model = language.LanguageModel()
    assert language.held_out_loss(model, x, y) == pytest.approx(math.log(language.VOCAB), rel=0.05)


@pytest.mark.parametrize("name", families.OPTIMIZERS)
def test_every_optimizer_is_built_and_only_clipped_sgd_clips(name):
    opt = families.make_optimizer(name, [torch.nn.Parameter(torch.zeros(2))], 0.1)
    assert opt.param_groups[0]["lr"] == 0.1
    assert bool(families.clipping(name)) == (name == "sgd-clip")
    with pytest.raises(ValueError, match="'lion' is not one of"):
        families.make_optimizer("lion", [], 0.1)


@pytest.mark.timeout(300)
def test_a_tiny_staleness_grid_trains_chooses_and_reports(tmp_path, monkeypatch):
    monkeypatch.setattr(study, "EPOCHS", 2)
    monkeypatch.setattr(study, "STALE_EPOCHS", 3)
    monkeypatch.setattr(study, "LAST", 1)
    monkeypatch.setattr(study, "MAX_EXTENSIONS", 0)
    monkeypatch.setattr(study, "SEEDS", (0,))
    monkeypatch.setattr(study, "STALE", (("async", 4, 1),))
    monkeypatch.setattr(study, "RULES", ("momentum", "none"))
    monkeypatch.setattr(study, "FAMILY_NAMES", ("lm",))
    monkeypatch.setattr(study, "OPTIMIZER_NAMES", ("sgd-clip",))
    monkeypatch.setattr(language, "SEQUENCES", 200)
    study.main(["--out", str(tmp_path)])
    rows = [r for r in read_rows(tmp_path / "runs.jsonl")]
    # three rates swept on the tuning seed, then hardsync and one stale run per rule on the reported seed
    assert sorted(r["seed"] for r in rows) == [0, 0, 0, study.TUNE_SEED, study.TUNE_SEED, study.TUNE_SEED]
    stale = [r for r in rows if r["protocol"] == "async"]
    assert {r["rule"] for r in stale} == {"momentum", "none"} and all(len(r["errors"]) == 3 for r in stale)
    findings = (tmp_path / "findings.md").read_text()
    assert "lm" in findings and "sgd-clip" in findings and "entropy" in findings
    # the report is rebuilt from runs.jsonl alone
    (tmp_path / "findings.md").unlink()
    study.main(["--out", str(tmp_path), "--report-only"])
    assert (tmp_path / "findings.md").read_text() == findings
    assert "3 reported runs (and 3 of the rate sweeps)" in findings
    # a grid stopped during its sweep still reports what it has
    lines = (tmp_path / "runs.jsonl").read_text().splitlines()
    (tmp_path / "runs.jsonl").write_text(lines[0] + "\n")
    study.main(["--out", str(tmp_path), "--report-only"])
    assert "0 reported runs (and 1 of the rate sweeps)" in (tmp_path / "findings.md").read_text()


@pytest.mark.slow
def test_the_runner_trains_the_language_model_and_measures_its_held_out_loss(tmp_path):
    from examples.study import runner

    result = tmp_path / "run.json"
    runner.main(
        ["--family", "lm", "--protocol", "single", "--batch-size", "64", "--lr", "4", "--clip", "0.25"]
        + ["--epochs", "1", "--curve", "--seed", "0", "--result", str(result)]
    )
    row = json.loads(result.read_text())
    assert (row["family"], row["clip"], row["test_error"]) == ("lm", 0.25, None)
    assert len(row["curve"]) == 1 and row["curve"][0][1] < math.log(language.VOCAB)  # it learned something
    assert row["test_loss"] == pytest.approx(row["curve"][0][1], rel=0.05)


def test_a_run_reaches_a_target_from_the_first_epoch_it_stays_at_or_below_it_and_a_nan_never_does():
    from examples.study.language_real import reached

    assert reached([[1, 3.0], [2, 1.9], [3, 2.1], [4, 1.95], [5, 1.9]], 2.0) == 4
    assert reached([[1, 3.0], [2, 1.9], [3, math.nan]], 2.0) is None
    assert reached([[1, 1.0]], math.nan) is None


def test_the_real_runs_target_is_a_share_of_ddps_loss_or_a_margin_over_its_error():
    from examples.study.language_real import SETUPS

    assert SETUPS["lm"].target(2.0) == pytest.approx(2.04) and SETUPS["cnn"].target(0.17) == pytest.approx(0.18)


def test_the_epochs_to_target_are_those_after_which_a_stale_run_stays_within_the_target_of_hardsync():
    from examples.study.staleness_report import epochs_to_target, gaps

    def row(protocol, errors, rule="momentum", seed=0):
        return dict(family="cnn", optimizer="sgd", protocol=protocol, learners=4, n=1, rule=rule, seed=seed,
                    errors=errors)  # fmt: skip

    hard = row("hardsync", [0.5] * (study.EPOCHS - 1) + [0.30])
    late = [0.9, 0.5, 0.31, 0.40, 0.315] + [0.31] * (study.STALE_EPOCHS - 5)  # within 2 points from epoch 5 on
    ends_out = [0.30] * (study.STALE_EPOCHS - 1) + [0.33]
    rows = [hard, row("async", late), row("async", ends_out, "none"), row("async", [0.1] * study.STALE_EPOCHS, "clip")]
    reach = epochs_to_target(rows)
    assert reach["cnn", "sgd", "async λ=4", "momentum"] == [5.0]
    assert reach["cnn", "sgd", "async λ=4", "none"] == [math.inf]
    assert reach["cnn", "sgd", "async λ=4", "clip"] == [1.0]
    at_hardsyncs = gaps(rows, "errors", study.EPOCHS)
    assert at_hardsyncs["cnn", "sgd", "async λ=4", "momentum"] == [pytest.approx(1.0)]
