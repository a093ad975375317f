"""dgrad.train's metrics files, progress lines, exported model, evaluation and optimizer."""

import io
import math
import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dgrad
from dgrad import data, models
from dgrad.train import build, export, metrics
from dgrad.train import config as fields
from dgrad.train.evaluate import Limited, evaluate
from dgrad.train.progress import Progress


def test_a_missing_metrics_file_has_no_records_and_all_kinds_are_read_in_order(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert metrics.read(path) == []
    with metrics.MetricWriter(path) as writer:
        writer.write({"kind": "train", "step": 4, "loss": 2.0})
        writer.write({"kind": "epoch", "step": 8, "epoch": 1})
    assert [r["step"] for r in metrics.read(path)] == [4, 8]
    assert metrics.read(path, kind="probe") == []


def test_the_corpus_fingerprint_goes_into_a_record_and_comes_back_out():
    record = metrics.with_corpus({"epoch": 1}, {"python": "3.11.7", "sha256": "0ff1ce"})
    assert metrics.corpus_of(record) == {"python": "3.11.7", "sha256": "0ff1ce"}
    assert metrics.corpus_of({"epoch": 1}) == {}


def test_a_closed_metric_writer_refuses_to_write(tmp_path):
    writer = metrics.MetricWriter(tmp_path / "m.jsonl")
    assert not writer.has_tensorboard  # none asked for
    writer.close()
    with pytest.raises(ValueError, match="I/O operation on closed file"):
        writer.write({"kind": "train", "step": 1})


def test_without_a_bar_a_line_names_the_label_step_and_percent_and_text_goes_to_the_log():
    out, log = io.StringIO(), []
    with Progress(total=20, start=10, batch_size=8, stream=out, every=5, label="FDG ") as progress:
        progress.update(15)
        progress.write("epoch 1", log.append)
        progress.update(17)  # neither a multiple of 5 nor the last: no line
        progress.update(20)
    lines = [line.split(" |")[0] for line in out.getvalue().splitlines()]
    assert lines == ["FDG step 15/20  75%", "FDG step 20/20 100%"]
    assert log == ["epoch 1"]


def test_the_merged_model_takes_any_batch_size_and_saves_to_an_absolute_path(tmp_path, monkeypatch):
    pipe = dgrad.Pipeline(
        models.mlp([4, 8, 3], num_stages=2), method="ddg", optimizer=optax.sgd(0.1)
    )
    model = export.merge(pipe, pipe.init((jnp.ones((2, 4)), jnp.zeros((2,), jnp.int32))))
    assert len(model.layers) == 2
    outputs = model(jnp.ones((5, 4)))
    assert outputs.shape == (5, 3) and len(outputs.devices()) == 1
    monkeypatch.chdir(tmp_path)
    path = export.save(model, "model")
    assert path == str(tmp_path / "model") and os.path.isdir(path)


def test_limited_never_holds_more_than_its_source_and_gets_the_source_s_examples():
    source = data.synthetic(10, (2, 2, 1))
    few = Limited(source, 4)
    assert (len(few), len(Limited(few, 100))) == (4, 4)
    assert (few.get(np.arange(3))[1] == source.labels[:3]).all()


def test_evaluation_counts_the_padding_of_the_last_batch_for_nothing():
    ds = data.load("digits")
    pipe = dgrad.Pipeline(
        models.mlp([64, 32, 10], num_stages=2), method="fdg", optimizer=optax.sgd(0.1)
    )
    state = pipe.init(data.Stream(ds.train, 32, transform=ds.train_transform, seed=0).batch(0))
    beats = []
    record = evaluate(
        pipe, state, Limited(ds.test, 150), ds.eval_transform, 100, on_batch=lambda: beats.append(1)
    )
    correct = record["test_accuracy"] * 150  # 150 examples: the 50 of padding count for none
    assert abs(correct - round(correct)) < 1e-3 and len(beats) == 2
    assert 0 < record["test_loss"] < math.inf


def test_an_epoch_is_the_config_s_steps_if_fewer_and_a_cut_one_the_split_s():
    config = fields.base()
    config.dataset, config.batch_size = "digits", 100
    dataset = build.load_dataset(config)  # 1438 examples: 14 batches of 100
    config.steps_per_epoch = 5
    assert build.steps_per_epoch(config, dataset) == 5
    config.steps_per_epoch = 50
    assert build.steps_per_epoch(config, dataset, cut=True) == 14
    with pytest.raises(ValueError, match="more than the 14 batches of 100 in digits's"):
        build.steps_per_epoch(config, dataset)


def test_a_warm_up_rises_from_a_hundredth_of_the_rate_and_epochs_count_updates():
    config = fields.base()  # lr 0.1, divided by 10 at epochs 150, 225 and 275 (FDG)
    config.optimizer.warmup_epochs = 1  # 10 updates: lr * (0.01 + 0.99 * (n + 1) / 10)
    rate = build.learning_rate(config, "fdg", steps_per_epoch=10)
    assert [round(float(rate(n)), 6) for n in (0, 4, 9, 10)] == [0.0109, 0.0505, 0.1, 0.1]
    config.optimizer.warmup_epochs = 0
    rate = build.learning_rate(config, "fdg", steps_per_epoch=10, accumulate=2)  # 5 an epoch
    assert [round(float(rate(n)), 6) for n in (749, 750)] == [0.1, 0.01]


def test_fdg_s_optimizer_is_plain_momentum_where_ddg_s_is_nesterov():
    config = fields.base()
    steps = {}
    for method in ("ddg", "fdg"):
        tx = build.build_optimizer(config, method, steps_per_epoch=10)
        steps[method] = tx.update(jnp.ones(2), tx.init(jnp.zeros(2)), jnp.zeros(2))[0]
    np.testing.assert_allclose(steps["ddg"], [-0.19, -0.19], rtol=1e-6)  # lr * (1 + 0.9)
    np.testing.assert_allclose(steps["fdg"], [-0.1, -0.1], rtol=1e-6)
