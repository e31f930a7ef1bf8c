"""The examples end to end, as a user runs them: the Quickstart's MNIST-1D config through LightningCLI (popen
launcher: the script is re-run for every learner), once as it is and once with a registered strategy name, and a
three-run tradeoff study (one of simulated learners). Each CLI run starts λ = 2 learner processes and one server
process and costs 15-30 s on two CPU cores."""

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MNIST1D_CONFIGS = sorted(p.name for p in (REPO / "examples" / "configs").glob("mnist1d_*.yaml"))
ACCURACY = re.compile(r"^final test accuracy: (\d\.\d+)$", re.MULTILINE)
STALENESS = re.compile(r"^staleness: mean σ = (\d+\.\d+), max σ = (\d+)$", re.MULTILINE)
SUBPROCESS_TIMEOUT = 240

pytestmark = pytest.mark.slow


def run_python(args: list[str], timeout: float = SUBPROCESS_TIMEOUT) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.pop("MASTER_PORT", None)  # Lightning picks a free port
    env.setdefault("OMP_NUM_THREADS", "1")  # learners and server share the cores
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def run_mnist1d_cli(tmp_path: Path, config: str, *overrides: str) -> subprocess.CompletedProcess:
    """Fit, test and print the summary, as ``python -m examples.mnist1d --config ...`` does; tiny and short."""
    return run_python(
        [
            "-m",
            "examples.mnist1d",
            "--config",
            f"examples/configs/{config}",
            "--trainer.max_epochs=1",
            "--data.num_samples=600",
            "--trainer.devices=2",
            "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path / 'logs'}",
            *overrides,
        ]
    )


def assert_trained_and_summarised(proc: subprocess.CompletedProcess) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{output[-6000:]}"
    accuracy = ACCURACY.search(proc.stdout)
    assert accuracy is not None, f"no 'final test accuracy: ...' line\n{output[-6000:]}"
    assert 0.0 <= float(accuracy.group(1)) <= 1.0
    assert re.search(r"^updates applied: [1-9]\d*, gradients: [1-9]\d*, dropped: \d+", proc.stdout, re.MULTILINE), (
        output[-3000:]
    )
    assert STALENESS.search(proc.stdout), output[-3000:]
    assert "staleness histogram: σ=" in proc.stdout, output[-3000:]
    # printed once, by learner 0
    assert len(ACCURACY.findall(proc.stdout)) == 1
    # a quiet console: no C++ warning from torch (TensorPipe's about peers leaving at the end, above all)
    assert not re.search(r"^\[W\d", proc.stderr, re.MULTILINE), proc.stderr[-3000:]


@pytest.mark.timeout(300)
def test_the_quickstart_config_trains_through_the_cli(tmp_path):
    proc = run_mnist1d_cli(tmp_path, "mnist1d_nsoftsync.yaml")
    assert_trained_and_summarised(proc)
    assert list((tmp_path / "logs").rglob("metrics.csv")), "the CSVLogger did not write under the given save_dir"


def built_strategy(config: str) -> tuple[dict, object]:
    """A config's YAML and the strategy its ``trainer.strategy`` block builds, as LightningCLI builds it."""
    import yaml
    from jsonargparse import ArgumentParser

    from lightning_rudra import RudraStrategy

    loaded = yaml.safe_load((REPO / "examples" / "configs" / config).read_text())
    parser = ArgumentParser()
    parser.add_subclass_arguments(RudraStrategy, "strategy")
    built = parser.instantiate_classes(parser.parse_object({"strategy": loaded["trainer"]["strategy"]})).strategy
    assert isinstance(built, RudraStrategy)
    return loaded, built


@pytest.mark.parametrize("config", MNIST1D_CONFIGS)
def test_every_mnist1d_config_builds_its_strategy(config):
    """Each config's strategy block builds (the Quickstart's also trains above; a registered name on the command line:
    tests/strategy/test_strategy_config.py)."""
    loaded, built = built_strategy(config)
    assert built.protocol == loaded["trainer"]["strategy"]["init_args"]["protocol"]
    assert len(MNIST1D_CONFIGS) >= 4, MNIST1D_CONFIGS


def _csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.timeout(300)
def test_study_writes_results_and_resumes(tmp_path):
    out = tmp_path / "study"
    first = run_python(["-m", "examples.study", "--grid", "tiny", "--out", str(out)])
    assert first.returncode == 0, (first.stdout + first.stderr)[-6000:]
    assert "[1/3] single" in first.stdout and "[2/3] softsync n=1 λ=2" in first.stdout, first.stdout
    assert "[3/3] softsync n=2 λ=8 μ=4 lr_mod=mean simulated" in first.stdout, first.stdout
    assert first.stdout.count("test error") == 3, first.stdout

    rows = _csv_rows(out / "runs.csv")
    assert [(r["protocol"], r["learners"], r["simulated"]) for r in rows] == [
        ("single", "1", "0"),
        ("softsync", "2", "0"),
        ("softsync", "8", "1"),
    ]
    for r in rows:
        assert 0.0 <= float(r["test_error"]) <= 1.0
        assert float(r["wall_s"]) > 0 and float(r["samples_per_s"]) > 0 and int(r["updates"]) > 0
        assert r["mu_lambda"] == str(int(r["batch_size"]) * int(r["learners"]))
    softsync = rows[1]
    # 1-softsync on λ=2: c = 2 per update; a last odd gradient is applied alone when training ends
    assert int(softsync["updates"]) == -(-int(softsync["gradients"]) // 2)
    assert float(softsync["mean_staleness"]) <= 2 and softsync["dropped"] == "0"
    simulated = rows[2]
    # 2-softsync on λ = 8 simulated learners: an update every 4 gradients, ⟨σ⟩ near n(λ−1)/λ = 1.75
    assert int(simulated["updates"]) == -(-int(simulated["gradients"]) // 4)
    assert 1.0 < float(simulated["mean_staleness"]) < 2.5

    table = (out / "results.md").read_text()
    assert "| protocol | n | λ | μ | μλ |" in table and table.count("\n| single |") == 1
    for png in ("error_vs_batch.png", "staleness.png", "error_vs_time.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png

    # resume: a finished run is never trained again; a missing one is
    with open(out / "runs.csv", newline="") as f:
        lines = f.readlines()
    (out / "runs.csv").write_text(lines[0] + lines[2] + lines[3])  # forget the single-learner run
    second = run_python(["-m", "examples.study", "--grid", "tiny", "--out", str(out), "--resume"])
    assert second.returncode == 0, (second.stdout + second.stderr)[-6000:]
    assert "[2/3] softsync n=1 λ=2 μ=16 lr_mod=mean ... already in" in second.stdout, second.stdout
    assert "[3/3] softsync n=2 λ=8 μ=4 lr_mod=mean simulated ... already in" in second.stdout, second.stdout
    assert second.stdout.count("test error") == 1, second.stdout  # only the single learner trained again
    assert "1 run(s) trained" in second.stdout and "2 skipped" in second.stdout, second.stdout
    rows_after = _csv_rows(out / "runs.csv")
    assert sorted(r["protocol"] for r in rows_after) == ["single", "softsync", "softsync"]
    assert rows_after[:2] == rows[1:]  # the other rows are untouched


@pytest.mark.timeout(300)
def test_the_language_model_example_trains_and_prints_its_test_loss(tmp_path):
    """The LSTM example through its config, one process without the strategy (its RudraStrategy block is built
    below): fit, test, and the loss in nats between the language's floor and far above uniform."""
    proc = run_python(
        [
            "-m",
            "examples.language_model",
            "--config",
            "examples/configs/language_model_async.yaml",
            "--trainer.strategy=auto",
            "--trainer.devices=1",
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=4",
            "--trainer.enable_progress_bar=false",
            f"--trainer.logger.init_args.save_dir={tmp_path / 'logs'}",
        ]
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    loss = re.search(r"^final test loss: (\d+\.\d+)$", proc.stdout, re.MULTILINE)
    assert loss is not None and 1.5 < float(loss.group(1)) < 4.5, proc.stdout[-3000:]


def test_the_language_model_config_builds_its_strategy():
    config, built = built_strategy("language_model_async.yaml")
    assert built.protocol == "async" and built.compensation == "momentum+clip+syncnorm+dana"
    assert config["trainer"]["gradient_clip_val"] == 0.25
