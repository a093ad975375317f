"""Config fields, files and the shipped configs (dgrad.train.config):
mistakes name the field or the line, the papers' and the language models' settings."""

import os

import numpy as np
import pytest
import tensorflow_datasets as tfds
from helpers import ROOT
from training import PAPER_CONFIGS, quiet, small_config

from dgrad import data
from dgrad.train import SetupError, build, train
from dgrad.train import config as fields
from dgrad.train.cli import load_config
from dgrad.train.config import recipes


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("method", "sgd", "Unknown method 'sgd'"),
        ("dataset", "mnist", "choose one of"),
        ("num_stages", 0, "positive integer"),
        ("beta", 1.5, r"beta must lie in \(0, 1\]"),
        ("baseline", "ddg", "choose one of: '', bp"),
        ("keep_checkpoints", 1, "keep at least 2"),
        ("peak_tflops", -1.0, "or 0 for no MFU"),
        ("checkpoint_every_steps", -1, "use 0 or more"),
        ("seed", -1, "use 0 or more"),
        ("optimizer.learning_rate", float("nan"), "use a positive rate"),
        ("optimizer.learning_rate", float("inf"), "use a positive rate"),
        ("optimizer.decay", -3.0, "use a positive factor"),
        ("optimizer.weight_decay", float("nan"), "use 0 or more"),
        ("steps_per_epoch", 100, "more than the 22 batches of 64 in digits's training split"),
        ("microbatches", 4, "method=fdg has no microbatches"),
        ("model.hidden", (128, 0), "use positive layer sizes"),
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


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(model__name="mlp"), "text \\(stdlib, a tfds text dataset\\) trains model gpt"),
        (dict(method="dgl"), "DGL's auxiliary heads pool images"),
        (dict(model__heads=3), "use a divisor of model.width"),
        (dict(model__heads=0), r"model.heads = 0 is not valid: use a positive integer"),
        (dict(context=0), r"config.context = 0 is not valid: use a positive integer"),
        (dict(model__width=0), r"model.width = 0 is not valid: use a positive integer"),
        (dict(model__depth=-3), r"model.depth = -3 is not valid: use a positive integer"),
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
