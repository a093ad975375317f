"""dgrad.train in this process: configs, the workdir's rules, resume bit for bit,
stopping at any moment, extending, the papers' configs."""

import glob
import json
import os
import signal

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds
from flax import nnx
from helpers import ROOT, assert_equal

import dgrad
from dgrad import data
from dgrad.train import SetupError, Stopped, StopRequests, build, export, metrics, recipes, train
from dgrad.train import config as fields
from dgrad.train.checkpoint import Checkpointer
from dgrad.train.cli import load_config

PAPER_CONFIGS = sorted(glob.glob(str(ROOT / "experiments/configs/cifar*.py")))


def quiet(text):
    pass


def small_config(**overrides):
    """The default config cut to a few seconds: an MLP, one run, 2 short epochs."""
    config, _ = load_config(str(ROOT / "experiments/configs/default.py:smoke"))
    config.model.name = "mlp"
    config.baseline = ""
    config.num_epochs = 2
    config.steps_per_epoch = 8
    config.log_every_steps = 3
    config.checkpoint_every_steps = 5
    config.update(overrides)
    return config


def records(workdir, run):
    return [
        {k: v for k, v in r.items() if k != "seconds"}
        for r in metrics.read(workdir / run / "metrics.jsonl")
    ]


def _stop_at_call(monkeypatch, call):
    """Makes the `call`-th `Pipeline.step` ask the run to stop (as SIGTERM would)."""
    original, calls = dgrad.Pipeline.step, [0]

    def step(self, state, batch):
        calls[0] += 1
        if calls[0] == call:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, state, batch)

    monkeypatch.setattr(dgrad.Pipeline, "step", step)
    return lambda: monkeypatch.setattr(dgrad.Pipeline, "step", original)


@pytest.mark.parametrize(
    "method, microbatches, optimizer",
    [
        ("fdg", None, "sgd"),
        pytest.param("ddg", None, "sgd", marks=pytest.mark.slow),
        ("gpipe", 4, "sgd"),
        pytest.param("1f1b", 2, "sgd", marks=pytest.mark.slow),
        pytest.param("pipedream", None, "sgd", marks=pytest.mark.slow),
        ("2bw", 2, "sgd"),
        ("fdg", None, "adamw"),
        pytest.param("ddg", None, "muon", marks=pytest.mark.slow),
        pytest.param("fdg", None, "async_nesterov", marks=pytest.mark.slow),
    ],
)
def test_a_stopped_run_resumes_to_the_same_bits_on_another_layout(
    tmp_path, monkeypatch, method, microbatches, optimizer
):
    config = small_config(method=method, num_stages=3, microbatches=microbatches)
    config.optimizer.name, config.optimizer.clip_norm = (
        optimizer,
        1.0 if optimizer != "sgd" else 0.0,
    )
    if optimizer != "sgd":
        config.optimizer.learning_rate = 1e-3
    train(config, tmp_path / "whole", devices=jax.devices()[:3], log=quiet)

    restore = _stop_at_call(monkeypatch, 13)
    with pytest.raises(Stopped) as stopped:
        train(config, tmp_path / "cut", devices=jax.devices()[:3], log=quiet)
    restore()
    assert stopped.value.checkpoint_step == 13 and stopped.value.signal_number == signal.SIGTERM
    run = f"{method}_k3" + (f"_m{microbatches}" if microbatches else "")
    title = f"{method.upper()} K=3" + (f" M={microbatches}" if microbatches else "")
    assert sorted(os.listdir(tmp_path / "cut" / run / "checkpoints")) == ["10", "13"]
    lines = []
    train(config, tmp_path / "cut", devices=jax.devices()[::-1], log=lines.append)
    assert any("resumed from the checkpoint at step 13" in line for line in lines)
    assert records(tmp_path / "cut", run) == records(tmp_path / "whole", run)

    lines = []  # once more: finished, nothing is built or trained
    again = train(config, tmp_path / "cut", log=lines.append)
    assert lines == [f"{tmp_path / 'cut'} finished earlier: nothing left to train."]
    assert again[title] == records(tmp_path / "cut", run)[-1] | {"seconds": again[title]["seconds"]}
    dataset = data.load(config.dataset)
    stages = build.build_stages(config, config.num_stages, dataset)
    whole = nnx.state(export.load(stages, tmp_path / "whole" / run / "model"))
    stages = build.build_stages(config, config.num_stages, dataset)
    cut = nnx.state(export.load(stages, tmp_path / "cut" / run / "model"))
    assert_equal(cut, whole)


def test_the_loop_reads_a_steps_metrics_after_the_next_is_dispatched(tmp_path, monkeypatch):
    """Only evaluation and saving (epoch ends, every 5 steps) wait for the step just
    dispatched; a log step's record (every 3) is written one step later, the same."""
    from dgrad.train import loop

    step_of, dispatched, reads = {}, [0], []
    original_step, original_add = dgrad.Pipeline.step, loop.Tally.add

    def step(self, state, batch):
        state, step_metrics = original_step(self, state, batch)
        dispatched[0] = state.step
        if "loss" in step_metrics:
            step_of[id(step_metrics["loss"])] = state.step
        return state, step_metrics

    def add(self, reported):
        if "loss" in reported:
            reads.append((dispatched[0], step_of[id(reported["loss"])]))
        return original_add(self, reported)

    monkeypatch.setattr(dgrad.Pipeline, "step", step)
    monkeypatch.setattr(loop.Tally, "add", add)
    config = small_config(method="bp")
    train(config, tmp_path / "run", devices=jax.devices()[:2], log=quiet)
    waited = sorted(latest for latest, read in reads if read == latest)
    assert waited == [5, 8, 10, 15, 16]  # the save steps, epoch ends among them
    assert sorted(read for _, read in reads) == list(range(1, 17))  # each step read once
    logged = [r["step"] for r in records(tmp_path / "run", "bp_k2") if r["kind"] == "train"]
    assert logged == [3, 6, 8, 9, 12, 15, 16]


def test_a_stop_during_a_save_keeps_the_checkpoint_whole(tmp_path, monkeypatch):
    original = Checkpointer.save

    def save(self, state, extra=None):
        if state.step == 5:
            os.kill(os.getpid(), signal.SIGINT)  # arrives while this save runs
        return original(self, state, extra)

    monkeypatch.setattr(Checkpointer, "save", save)
    with pytest.raises(Stopped) as stopped:
        train(small_config(), tmp_path, log=quiet)
    monkeypatch.setattr(Checkpointer, "save", original)
    assert stopped.value.signal_number == signal.SIGINT
    assert stopped.value.checkpoint_step == 6  # the save at 5 finished; the next step saved too
    with Checkpointer(tmp_path / "fdg_k2" / "checkpoints") as checkpoints:
        assert checkpoints.all_steps() == [5, 6]
    lines = []
    train(small_config(), tmp_path, log=lines.append)
    assert any("resumed from the checkpoint at step 6" in line for line in lines)


def test_a_run_killed_before_its_first_checkpoint_or_its_export_resumes_whole(tmp_path):
    """SIGKILL leaves what was written: records of steps without a checkpoint (they are
    redone), or a final checkpoint without the exported model and the curves."""
    import shutil

    config, run = small_config(), "fdg_k2"
    train(config, tmp_path / "whole", log=quiet)
    expected = records(tmp_path / "whole", run)

    def exported(workdir):
        stages = build.build_stages(config, config.num_stages, data.load(config.dataset))
        return nnx.state(export.load(stages, workdir / run / "model"))

    early = tmp_path / "early"
    shutil.copytree(tmp_path / "whole", early)
    shutil.rmtree(early / run / "checkpoints")
    shutil.rmtree(early / run / "model")
    metrics.truncate(early / run / "metrics.jsonl", after_step=4)  # before the save at 5
    train(config, early, log=quiet)
    assert records(early, run) == expected

    for killed in ("before the export", "before the plot"):
        late = tmp_path / killed.replace(" ", "_")
        shutil.copytree(tmp_path / "whole", late)  # (keeps the files' times)
        if killed == "before the export":
            shutil.rmtree(late / run / "model")
        else:  # the plot of a run before it (a baseline's), drawn before this export
            drawn = (late / run / "model").stat().st_mtime_ns - 10**9
            os.utime(late / "curves.png", ns=(drawn, drawn))
        lines = []
        train(config, late, log=lines.append)
        assert any("finished earlier, at step 16" in line for line in lines), killed
        assert (late / "curves.png").stat().st_mtime_ns >= (late / run / "model").stat().st_mtime_ns
        assert records(late, run) == expected
        assert_equal(exported(late), exported(tmp_path / "whole"))


def test_a_second_command_in_a_workdir_being_trained_is_refused(tmp_path):
    from dgrad.train import workdir

    train(small_config(num_epochs=1), tmp_path / "run", log=quiet)
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")}
    for path in (tmp_path / "run", tmp_path / "new"):
        with workdir.hold(path):  # as a command training there does
            with pytest.raises(SetupError, match="another command is training in"):
                train(small_config(num_epochs=2), path, extend=path.name == "run", log=quiet)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")} == before
    assert os.listdir(tmp_path / "new") == [".lock"]
    train(small_config(num_epochs=1), tmp_path / "new", log=quiet)  # the lock is gone
    assert (tmp_path / "new" / "fdg_k2" / "model").is_dir()


def test_a_workdir_started_with_more_steps_per_epoch_than_batches_resumes(tmp_path, monkeypatch):
    """Earlier versions cut such a steps_per_epoch silently; new runs are refused it."""
    config = small_config(steps_per_epoch=100, num_epochs=1)  # the digits hold 22 batches
    _stop_at_call(monkeypatch, 13)
    monkeypatch.setattr(build, "steps_per_epoch", lambda config, dataset, cut=False: 22)
    with pytest.raises(Stopped):
        train(config, tmp_path, log=quiet)
    monkeypatch.undo()
    lines = []
    train(config, tmp_path, log=lines.append)
    assert any("this workdir trains 22 per epoch, as it was started" in line for line in lines)
    assert [r["step"] for r in metrics.read(tmp_path / "fdg_k2/metrics.jsonl", "epoch")] == [22]


def test_a_workdir_another_command_started_meanwhile_is_decided_again(tmp_path, monkeypatch):
    """Between the first look at the workdir and taking its lock another command may have
    started an experiment there: the config it wrote is not overwritten."""
    from dgrad.train import workdir

    other = small_config(seed=7)
    original = workdir.hold

    def hold_after_another(path):
        workdir.create(workdir.inspect(path, other), other)  # the other command, first
        return original(path)

    monkeypatch.setattr(workdir, "hold", hold_after_another)
    with pytest.raises(SetupError, match="holds another experiment .*seed 7 -> 0"):
        train(small_config(), tmp_path / "run", log=quiet)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["seed"] == 7


def test_a_stop_before_training_leaves_nothing_behind(tmp_path):
    stop = StopRequests()
    stop.request(signal.SIGTERM)
    with pytest.raises(Stopped, match="before training"):
        train(small_config(), tmp_path / "new", log=quiet, stop=stop)
    assert not (tmp_path / "new").exists()


def test_a_workdir_that_cannot_be_written_is_one_line():
    with pytest.raises(SetupError, match="cannot write in --workdir /proc/dgrad-run"):
        train(small_config(), "/proc/dgrad-run", log=quiet)


def test_a_failed_start_leaves_no_directory(tmp_path):
    with pytest.raises(SetupError, match="cannot be cut into num_stages=9"):
        train(small_config(num_stages=9), tmp_path / "new", log=quiet)
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(SetupError):
        train(small_config(num_stages=9), tmp_path / "empty", log=quiet)
    assert os.listdir(tmp_path / "empty") == []


def test_a_workdir_of_another_experiment_is_refused_before_anything_is_written(tmp_path):
    train(small_config(num_epochs=1), tmp_path, log=quiet)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    for changed in (small_config(num_epochs=1, beta=0.5), small_config(num_epochs=1, seed=3)):
        with pytest.raises(SetupError, match="holds another experiment"):
            train(changed, tmp_path, log=quiet)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before
    with pytest.raises(SetupError, match="add --extend"):
        train(small_config(num_epochs=2), tmp_path, log=quiet)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(SetupError, match="not a dgrad workdir"):
        train(small_config(), tmp_path / "other", log=quiet)
    # Fields that only change how the run is watched may differ.
    train(small_config(num_epochs=1, log_every_steps=4, placement="one_per_device"), tmp_path)


def test_extending_a_finished_run_says_what_it_does_to_the_schedule(tmp_path):
    config = small_config(num_epochs=1)
    train(config, tmp_path / "short", log=quiet)
    lines = []
    longer = small_config(num_epochs=2)
    train(longer, tmp_path / "short", extend=True, log=lines.append)
    note = next(line for line in lines if line.startswith("Extending"))
    assert "from 1 to 2 epochs" in note and "cosine" in note and "at step 8 the rate was" in note
    assert [r["epoch"] for r in metrics.read(tmp_path / "short/fdg_k2/metrics.jsonl", "epoch")] == [
        1,
        2,
    ]
    assert json.loads((tmp_path / "short" / "config.json").read_text())["num_epochs"] == 2
    with pytest.raises(SetupError, match="above the 2"):
        train(small_config(num_epochs=1), tmp_path / "short", extend=True, log=quiet)


def test_an_extension_that_was_stopped_resumes(tmp_path):
    train(small_config(num_epochs=1), tmp_path, log=quiet)
    stop = StopRequests()
    with pytest.raises(Stopped) as stopped:  # asked to stop as soon as the extension starts
        train(
            small_config(num_epochs=3),
            tmp_path,
            extend=True,
            stop=stop,
            log=lambda _: stop.request(),
        )
    assert stopped.value.checkpoint_step == 9
    train(small_config(num_epochs=3), tmp_path, extend=True, log=quiet)  # the same command
    epochs = metrics.read(tmp_path / "fdg_k2" / "metrics.jsonl", "epoch")
    assert [r["epoch"] for r in epochs] == [1, 2, 3]
    train(small_config(num_epochs=3), tmp_path, log=quiet)  # and without --extend: finished


@pytest.mark.parametrize(
    "overrides",
    [dict(method="fr"), dict(method="dgl", probe_every=4), dict(accumulate=2, probe_every=5)],
)
def test_the_family_trains_from_a_config(tmp_path, overrides):
    config = small_config(num_epochs=1, **overrides)
    results = train(config, tmp_path, log=quiet)
    (record,) = results.values()
    assert 0 <= record["test_accuracy"] <= 1
    probes = metrics.read(tmp_path / f"{config.method}_k2" / "metrics.jsonl", "probe")
    if config.probe_every:
        assert {r["stage"] for r in probes} == {0, 1}
        assert all(-1 <= r["cosine"] <= 1 for r in probes)
    else:
        assert probes == []


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("method", "sgd", "Unknown method 'sgd'"),
        ("dataset", "mnist", "choose one of"),
        ("num_stages", 0, "positive integer"),
        ("beta", 1.5, r"beta must lie in \(0, 1\]"),
        ("baseline", "ddg", "choose one of: '', bp"),
        ("keep_checkpoints", 0, "positive integer"),
        ("checkpoint_every_steps", -1, "use 0 or more"),
        ("seed", -1, "use 0 or more"),
        ("optimizer.learning_rate", float("nan"), "use a positive rate"),
        ("optimizer.learning_rate", float("inf"), "use a positive rate"),
        ("optimizer.decay", -3.0, "use a positive factor"),
        ("optimizer.weight_decay", float("nan"), "use 0 or more"),
        ("steps_per_epoch", 100, "more than the 22 batches of 64 in digits's training split"),
        ("microbatches", 4, "method=fdg has no microbatches"),
    ],
)
def test_bad_config_values_name_the_field(tmp_path, field, value, message):
    config = small_config()
    config.unlock()
    fields.set_field(config, field, value)
    with pytest.raises(SetupError, match=message):
        train(config, tmp_path / "x", log=quiet)
    assert not (tmp_path / "x").exists()


def test_config_files_cannot_add_fields_or_change_types():
    config = fields.base()
    with pytest.raises(AttributeError, match="num_stage"):
        config.num_stage = 3
    with pytest.raises(TypeError, match="batch_size"):
        config.batch_size = "64"


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "def get_config():\n    c = fields.base()\n    c.num_stage = 4\n    return c\n",
            "line 4: num_stage is not a config field; did you mean num_stages?",
        ),
        (
            "def get_config():\n    c = fields.base()\n    c.batch_size = '64'\n    return c\n",
            "line 4: TypeError: Could not override field 'batch_size'",
        ),
        ("def get_config():\n    return {'method': 'fdg'}\n", "get_config returned a dict"),
        ("def get_config(:\n", "line 2: SyntaxError"),
        ("def get_config():\n    raise ValueError('one\\ntwo')\n", "line 3: one"),
        ("import no_such_module\n", "line 2: ModuleNotFoundError: No module named"),
        ("x = 1\n", "defines no get_config"),
    ],
)
def test_a_config_files_own_mistake_is_one_line_naming_its_line(tmp_path, text, message):
    from dgrad.train.cli import UsageError

    path = tmp_path / "mine.py"
    path.write_text("from dgrad.train import config as fields\n" + text)
    for spec in (str(path), os.path.relpath(path)):  # as given, relative or absolute
        with pytest.raises(UsageError) as raised:
            load_config(spec)
        assert message in str(raised.value) and "\n" not in str(raised.value)
        assert str(raised.value).startswith(f"--config {spec}")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(UsageError, match="is not a config file"):
        load_config(str(tmp_path / "notes.txt"))


def test_every_field_is_described_once():
    described = fields.describe()
    for field in fields.FIELDS:
        assert f"--config.{field.name} " in described and field.help
    assert len(set(fields.FIELD_NAMES)) == len(fields.FIELDS)
    assert set(fields.flatten(fields.base())) == set(fields.FIELD_NAMES)


@pytest.mark.parametrize(
    "path",
    [p if i == 0 else pytest.param(p, marks=pytest.mark.slow) for i, p in enumerate(PAPER_CONFIGS)],
    ids=os.path.basename,
)
def test_paper_configs_follow_the_authors(path):
    config, _ = load_config(path)
    assert config.dataset in ("cifar10", "cifar100")
    assert (config.method, config.beta, config.split) == ("fdg", 1.0, "authors")
    assert (config.batch_size, config.num_epochs) == (128, 300)
    optimizer = recipes.resolved_optimizer(config, "fdg")
    assert optimizer["learning_rate"] == 0.1 and optimizer["momentum"] == 0.9
    assert optimizer["weight_decay"] == 5e-4 and optimizer["boundaries"] == (150, 225, 275)
    assert recipes.resolved_optimizer(config, "ddg")["boundaries"] == (150, 225)
    assert recipes.resolved_optimizer(config, "ddg")["nesterov"] is True
    smoke, _ = load_config(path + ":smoke")
    assert (smoke.method, smoke.num_stages, smoke.dataset) == (
        config.method,
        config.num_stages,
        config.dataset,
    )
    dataset = data.Dataset("x", None, None, None, None, 10, (32, 32, 3))
    assert len(build.build_stages(smoke, smoke.num_stages, dataset)) == smoke.num_stages
    for method in ("ddg", "bp"):  # --config.method=... alone gives a valid config
        config.method = method
        fields.check(config)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cifar10_resnet56", "cifar10_wrn28_10", "cifar10_resnet1202"])
def test_paper_configs_build_with_the_authors_split(name):
    config, _ = load_config(str(ROOT / "experiments/configs" / f"{name}.py"))
    dataset = data.Dataset(name, None, None, None, None, 10, (32, 32, 3))
    assert len(build.build_stages(config, config.num_stages, dataset)) == config.num_stages


@pytest.mark.slow
def test_smoke_paper_config_trains_on_mock_cifar(tmp_path):
    """The tfds path end to end: augmentation, both runs, evaluation, export."""
    config, _ = load_config(str(ROOT / "experiments/configs/cifar10_resnet56.py:smoke"))
    config.num_epochs, config.steps_per_epoch, config.batch_size = 1, 2, 8
    config.eval_examples, config.eval_batch_size, config.baseline = 12, 8, "bp"
    with tfds.testing.mock_data(num_examples=24, policy=tfds.testing.MockPolicy.USE_CODE):
        results = train(config, tmp_path, log=quiet)
    assert set(results) == {"FDG K=2", "BP (fused)"}
    for record in results.values():
        assert 0 <= record["test_accuracy"] <= 1 and np.isfinite(record["test_loss"])
    assert (tmp_path / "curves.png").exists()


@pytest.mark.slow
def test_a_tfds_text_dataset_trains_the_gpt_and_keeps_its_bytes_beside_the_data(tmp_path):
    config, _ = load_config(str(ROOT / "experiments/configs/lm_stdlib.py:smoke"))
    config.dataset, config.data_dir = "tiny_shakespeare", str(tmp_path / "tfds")
    config.num_epochs, config.steps_per_epoch, config.batch_size = 1, 4, 8
    config.eval_examples, config.eval_batch_size = 16, 8
    with tfds.testing.mock_data(num_examples=200, policy=tfds.testing.MockPolicy.USE_CODE):
        results = train(config, tmp_path / "run", log=quiet)
    assert sorted(results) == ["BP (fused)", "FDG K=2"]
    for record in results.values():
        assert record["corpus_tfds"] == "tiny_shakespeare" and record["corpus_feature"] == "text"
        assert np.isfinite(record["test_bits_per_byte"])
    kept = sorted(p.name for p in (tmp_path / "tfds" / "dgrad_bytes").iterdir())
    assert kept == ["tiny_shakespeare-1.0.0-test-text.npy", "tiny_shakespeare-1.0.0-train-text.npy"]


@pytest.mark.parametrize(
    "name, shape, method, stages",
    [
        ("lm_asyncpp", (8, 768, 12, 512), "pipedream", 8),
        ("lm_gpt2_small", (12, 768, 12, 1024), "fdg", 4),
    ],
)
def test_the_gpu_language_model_configs_hold_their_settings(name, shape, method, stages):
    config, _ = load_config(str(ROOT / f"experiments/configs/{name}.py"))
    fields.check(config)
    model = (config.model.depth, config.model.width, config.model.heads, config.context)
    assert model == shape and (config.method, config.num_stages) == (method, stages)
    assert config.dataset == "lm1b" and config.optimizer.clip_norm == 1.0
    smoke, _ = load_config(str(ROOT / f"experiments/configs/{name}.py:smoke"))
    fields.check(smoke)
    assert (smoke.method, smoke.num_stages, smoke.dataset) == (method, stages, "lm1b")


@pytest.mark.slow
def test_the_asyncpp_smoke_config_trains_on_mock_lm1b(tmp_path):
    """Eight stages of the asynchronous pipeline with the delay-dependent Nesterov optimizer."""
    config, _ = load_config(str(ROOT / "experiments/configs/lm_asyncpp.py:smoke"))
    config.data_dir, config.num_epochs, config.steps_per_epoch = str(tmp_path / "tfds"), 1, 4
    with tfds.testing.mock_data(num_examples=300, policy=tfds.testing.MockPolicy.USE_CODE):
        results = train(config, tmp_path / "run", log=quiet)
    assert sorted(results) == ["BP (fused)", "PipeDream K=8"]
    assert all(np.isfinite(r["test_bits_per_byte"]) for r in results.values())


def test_a_tfds_text_feature_that_is_not_there_is_named_with_the_features(tmp_path):
    from dgrad import data

    with tfds.testing.mock_data(num_examples=4, policy=tfds.testing.MockPolicy.USE_CODE):
        with pytest.raises(data.DatasetNotFoundError, match="no feature 'body'.*\\(text\\)"):
            data.load("tiny_shakespeare:body", data_dir=str(tmp_path), context=8)


def test_the_language_model_config_trains_fdg_beside_bp_in_tokens(tmp_path):
    config, _ = load_config(str(ROOT / "experiments/configs/lm_stdlib.py:smoke"))
    results = train(config, tmp_path, log=quiet)
    assert sorted(results) == ["BP (fused)", "FDG K=2"]
    for record in results.values():
        assert record["test_perplexity"] == pytest.approx(np.exp(record["test_loss"]))
        assert record["test_bits_per_byte"] == pytest.approx(record["test_loss"] / np.log(2))
        assert record["tokens_per_second"] > 0 and record["corpus_files"] > 100
        assert record["test_loss"] < np.log(256)  # better than guessing among 256 bytes


@pytest.mark.slow
def test_subword_tokens_train_the_gpt_and_are_kept_for_the_next_run(tmp_path):
    """A BPE of 512 tokens trained on the training split: the model predicts 512 tokens,
    bits per byte count the test split's bytes per token, and a second run reuses it."""
    config, _ = load_config(str(ROOT / "experiments/configs/lm_stdlib.py:smoke"))
    config.tokenizer, config.vocab_size, config.data_dir = "bpe", 512, str(tmp_path / "data")
    config.num_epochs, config.baseline = 1, ""
    (record,) = train(config, tmp_path / "first", log=quiet).values()
    per_byte = record["corpus_test_tokens"] / record["corpus_test_bytes"]
    assert 0.2 < per_byte < 0.6  # subwords of 2-5 bytes
    assert record["test_bits_per_byte"] == pytest.approx(record["test_loss"] / np.log(2) * per_byte)
    saved = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "data" / "dgrad_tokens").iterdir()}
    assert sorted(p.rsplit(".", 1)[1] for p in saved) == ["json", "npy", "npy"]
    stages = build.build_stages(config, 2, build.load_dataset(config))
    assert stages[-1].layers[-1].logits.out_features == 512
    (again,) = train(config, tmp_path / "second", log=quiet).values()
    assert again["test_loss"] == record["test_loss"]  # the same tokens, the same run
    assert {
        p.name: p.stat().st_mtime_ns for p in (tmp_path / "data" / "dgrad_tokens").iterdir()
    } == saved


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(model__name="mlp"), "text \\(stdlib, a tfds text dataset\\) trains model gpt"),
        (dict(method="dgl"), "DGL's auxiliary heads pool images"),
        (dict(model__heads=3), "use a divisor of model.width"),
        (dict(optimizer__name="lamb"), "choose one of: sgd, adamw, muon, async_nesterov"),
        (dict(optimizer__clip_norm=-1.0), "use a norm > 0, or 0 for none"),
        (dict(tokenizer="wordpiece"), "choose one of: bytes, bpe"),
        (dict(tokenizer="bpe", vocab_size=200), "use more than 256 and at most 65536 tokens"),
        (dict(tokenizer="bpe", dataset="digits", model__name="mlp"), "tokenizes text"),
    ],
)
def test_bad_language_model_settings_name_the_field(overrides, message):
    config, _ = load_config(str(ROOT / "experiments/configs/lm_stdlib.py:smoke"))
    for name, value in overrides.items():
        fields.set_field(config, name.replace("__", "."), value)
    with pytest.raises(ValueError, match=message):
        fields.check(config)
