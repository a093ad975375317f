"""The experiment runner and its CLI: configs, workdir outputs, resume, errors."""

import glob
import importlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds
from flax import nnx

import dgrad
from dgrad import data, experiment, export, metrics
from experiments.configs import common, default

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAPER_CONFIGS = sorted(
    os.path.basename(p)[:-3] for p in glob.glob(str(ROOT / "experiments/configs/cifar*.py"))
)


def quiet(text):
    pass


def cli(*args, timeout=600):
    """`python -m experiments.train ARGS` in a fresh process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "experiments.train", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def small_config(**overrides):
    """The default config cut to a few seconds: one run, 2 short epochs."""
    config = default.get_config("smoke")
    config.baseline = ""
    config.num_epochs = 2
    config.steps_per_epoch = 8
    config.log_every_steps = 3
    config.checkpoint_every_steps = 5
    config.update(overrides)
    return config


def test_cli_default_smoke_run_learns_digits_and_writes_its_workdir(tmp_path):
    """A fresh process, as a user runs it: fake CPU devices, both runs, files, summary."""
    workdir = tmp_path / "run"
    args = ("--config", "experiments/configs/default.py:smoke", "--workdir", str(workdir))
    result = cli(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "No accelerator found: running 2 stage(s) on 2 fake CPU devices" in result.stdout
    summary = result.stdout.split("Test accuracy:")[1].split("Curves:")[0]
    accuracies = {
        line.rsplit(maxsplit=1)[0].strip(): float(line.split()[-1])
        for line in summary.splitlines()
        if line.strip()
    }
    assert set(accuracies) == {"FDG K=2", "BP (fused, 1 device)"}
    assert all(a > 0.8 for a in accuracies.values()), accuracies  # chance is 0.1
    assert str(workdir / "curves.png") in result.stdout and (workdir / "curves.png").exists()
    assert json.loads((workdir / "config.json").read_text())["method"] == "fdg"
    for run in ("fdg_k2", "bp_fused"):
        epochs = metrics.read(workdir / run / "metrics.jsonl", "epoch")
        assert [r["epoch"] for r in epochs] == [1, 2, 3]
        assert (workdir / run / "model").is_dir()
        assert (workdir / run / "checkpoints" / str(3 * 22)).is_dir()
    assert "step 66/66" in result.stderr  # progress lines, since stderr is not a terminal


def test_cli_stopped_by_a_signal_saves_and_resumes_without_losing_or_repeating_steps(tmp_path):
    overrides = ("--config.baseline=", "--config.num_epochs=4", "--config.log_every_steps=5")
    workdir = tmp_path / "stopped"
    process = subprocess.Popen(
        [sys.executable, "-m", "experiments.train", *overrides, "--workdir", str(workdir)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics_path = workdir / "fdg_k2" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not metrics.read(metrics_path, "train") and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 128 + signal.SIGINT, stderr[-3000:]
    stopped_at = int(stdout.split("Stopped at step ")[1].split()[0])
    assert 5 <= stopped_at < 88
    assert str(stopped_at) in os.listdir(workdir / "fdg_k2" / "checkpoints")

    resumed = cli(*overrides, "--workdir", str(workdir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from the checkpoint at step {stopped_at} " in resumed.stdout

    # The same run without a stop, in this process. (Bit-for-bit equality is tested in
    # process above; across processes with other fake device counts XLA's CPU
    # reductions may differ in the last bit.)
    config = small_config(steps_per_epoch=-1, num_epochs=4, log_every_steps=5)
    config.checkpoint_every_steps = 0
    experiment.train(config, tmp_path / "whole", devices=jax.devices()[:2], log=quiet)
    got = metrics.read(metrics_path)
    expected = metrics.read(tmp_path / "whole" / "fdg_k2" / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in got] == [(r["kind"], r["step"]) for r in expected]
    for a, b in zip(got, expected):
        for name in ("loss", "accuracy", "train_loss", "test_loss", "test_accuracy"):
            if name in b:
                assert a[name] == pytest.approx(b[name], rel=1e-5), (a, b)


def _crash_at(monkeypatch, call):
    original, calls = dgrad.Pipeline.step, [0]

    def step(self, state, batch):
        calls[0] += 1
        if calls[0] == call:
            raise KeyboardInterrupt
        return original(self, state, batch)

    monkeypatch.setattr(dgrad.Pipeline, "step", step)
    return lambda: monkeypatch.setattr(dgrad.Pipeline, "step", original)


def _load_model(config, path):
    dataset = data.load(config.dataset)
    model = export.load(experiment.build_stages(config, config.num_stages, dataset), path)
    return [np.asarray(a) for a in jax.tree.leaves(nnx.state(model))]


@pytest.mark.parametrize("method", ["fdg", "ddg"])
def test_a_stopped_run_resumes_to_the_same_bits_on_another_layout(tmp_path, monkeypatch, method):
    config = small_config(method=method, num_stages=3)
    experiment.train(config, tmp_path / "whole", devices=jax.devices()[:3], log=quiet)

    # Checkpoints come every 5 steps and at epoch ends (8, 16); stop after the one at 10.
    restore = _crash_at(monkeypatch, 13)
    with pytest.raises(KeyboardInterrupt):
        experiment.train(config, tmp_path / "cut", devices=jax.devices()[:3], log=quiet)
    restore()
    run = f"{method}_k3"
    assert sorted(os.listdir(tmp_path / "cut" / run / "checkpoints")) == ["10", "8"]
    lines = []
    experiment.train(config, tmp_path / "cut", devices=jax.devices()[::-1], log=lines.append)
    assert any("resumed from the checkpoint at step 10" in line for line in lines)

    def records(workdir):
        return [
            {k: v for k, v in r.items() if k != "seconds"}
            for r in metrics.read(workdir / run / "metrics.jsonl")
        ]

    assert records(tmp_path / "cut") == records(tmp_path / "whole")  # no step lost or repeated
    # Once more: everything is finished, nothing is retrained.
    lines = []
    again = experiment.train(config, tmp_path / "cut", log=lines.append)
    assert any("finished earlier, at step 16: nothing left to train" in line for line in lines)
    assert (
        again[f"{method.upper()} K=3"] == metrics.read(tmp_path / "cut" / run / "metrics.jsonl")[-1]
    )
    assert records(tmp_path / "cut") == records(tmp_path / "whole")
    whole = _load_model(config, tmp_path / "whole" / run / "model")
    cut = _load_model(config, tmp_path / "cut" / run / "model")
    assert len(whole) == len(cut) > 0
    for a, b in zip(whole, cut):
        np.testing.assert_array_equal(a, b)


def test_resuming_with_another_config_names_the_fields(tmp_path, monkeypatch):
    config = small_config()
    restore = _crash_at(monkeypatch, 7)
    with pytest.raises(KeyboardInterrupt):
        experiment.train(config, tmp_path, log=quiet)
    restore()
    changed = small_config(beta=0.5, batch_size=32)
    with pytest.raises(ValueError) as error:
        experiment.train(changed, tmp_path, log=quiet)
    assert "beta: checkpoint 1.0, now 0.5" in str(error.value)
    assert "batch_size: checkpoint 64, now 32" in str(error.value)
    assert json.loads((tmp_path / "config.json").read_text())["beta"] == 1.0  # kept
    # Fields that only change how the run is watched may differ.
    experiment.train(
        small_config(log_every_steps=4, placement="one_per_device"), tmp_path, log=quiet
    )


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("method", "sgd", "choose one of"),
        ("dataset", "mnist", "choose one of"),
        ("num_stages", 0, "positive integer"),
        ("beta", 1.5, "0 < beta <= 1"),
        ("baseline", "ddg", "'bp'"),
        ("keep_checkpoints", 0, "positive integer"),
        ("checkpoint_every_steps", -1, "0 \\(epoch ends\\) or more"),
    ],
)
def test_bad_config_values_name_the_field(tmp_path, field, value, message):
    config = small_config()
    config[field] = value
    with pytest.raises(ValueError, match=f"config.{field} = .*{message}"):
        experiment.train(config, tmp_path, log=quiet)


def test_beta_outside_fdg_is_refused(tmp_path):
    with pytest.raises(ValueError, match="shrinking is part of FDG"):
        experiment.train(small_config(method="ddg", beta=0.5), tmp_path, log=quiet)


def test_cli_reports_config_errors_without_a_traceback(tmp_path):
    result = cli("--config.method=sgd", "--workdir", str(tmp_path), timeout=300)
    assert result.returncode == 2
    assert "config.method = 'sgd' is not valid" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_says_how_to_get_a_missing_dataset(tmp_path):
    result = cli(
        "--config",
        "experiments/configs/cifar10_resnet56.py:smoke",
        f"--config.data_dir={tmp_path}",
        "--workdir",
        str(tmp_path / "run"),
        timeout=300,
    )
    assert result.returncode == 2
    assert "tfds build cifar10 --file_format=array_record" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_paper_configs_follow_the_authors(name):
    config = importlib.import_module(f"experiments.configs.{name}").get_config()
    assert config.dataset in ("cifar10", "cifar100")
    assert (config.method, config.beta, config.split) == ("fdg", 1.0, "authors")
    assert (config.batch_size, config.num_epochs) == (128, 300)
    optimizer = experiment.resolved_optimizer(config, "fdg")
    assert optimizer["learning_rate"] == 0.1 and optimizer["momentum"] == 0.9
    assert optimizer["weight_decay"] == 5e-4 and optimizer["boundaries"] == (150, 225, 275)
    assert experiment.resolved_optimizer(config, "ddg")["boundaries"] == (150, 225)
    assert experiment.resolved_optimizer(config, "ddg")["nesterov"] is True
    smoke = importlib.import_module(f"experiments.configs.{name}").get_config("smoke")
    assert (smoke.method, smoke.num_stages, smoke.dataset) == (
        config.method,
        config.num_stages,
        config.dataset,
    )
    dataset = data.Dataset(name, None, None, None, None, 10, (32, 32, 3))
    assert len(experiment.build_stages(smoke, smoke.num_stages, dataset)) == smoke.num_stages
    for method in ("ddg", "bp"):  # --config.method=... alone gives a valid config
        config.method = method
        experiment.check_config(config)


@pytest.mark.parametrize(
    "name", ["cifar10_resnet56", "cifar10_resnet110", "cifar10_wrn28_10", "cifar10_resnet1202"]
)
def test_paper_configs_build_with_the_authors_split(name):
    config = importlib.import_module(f"experiments.configs.{name}").get_config()
    dataset = data.Dataset(name, None, None, None, None, 10, (32, 32, 3))
    stages = experiment.build_stages(config, config.num_stages, dataset)
    assert len(stages) == config.num_stages


def test_unknown_config_variant_is_refused():
    with pytest.raises(ValueError, match="smoke"):
        common.paper("cifar10", "cifar_resnet", 56, variant="tiny")


def test_smoke_paper_config_trains_on_mock_cifar(tmp_path):
    """The tfds path end to end: augmentation, both runs, evaluation, export."""
    config = importlib.import_module("experiments.configs.cifar10_resnet56").get_config("smoke")
    config.num_epochs, config.steps_per_epoch, config.batch_size = 1, 2, 8
    config.eval_examples, config.eval_batch_size, config.baseline = 12, 8, "bp"
    with tfds.testing.mock_data(num_examples=24, policy=tfds.testing.MockPolicy.USE_CODE):
        results = experiment.train(config, tmp_path, log=quiet)
    assert set(results) == {"FDG K=2", "BP (fused, 1 device)"}
    for record in results.values():
        assert 0 <= record["test_accuracy"] <= 1 and np.isfinite(record["test_loss"])
    assert (tmp_path / "curves.png").exists()
