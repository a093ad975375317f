"""Text for language models end to end: tfds corpora, subword tokens, the language-model
configs training in tokens."""

import json

import numpy as np
import pytest
import tensorflow_datasets as tfds
from helpers import ROOT
from training import quiet

from dgrad import data
from dgrad.train import build, train
from dgrad.train.cli import load_config


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

    with tfds.testing.mock_data(num_examples=4, policy=tfds.testing.MockPolicy.USE_CODE):
        with pytest.raises(data.DatasetNotFoundError, match="no feature 'body'.*\\(text\\)"):
            data.load("tiny_shakespeare:body", data_dir=str(tmp_path), context=8)


@pytest.mark.slow
def test_the_language_model_config_trains_fdg_beside_bp_in_tokens(tmp_path):
    config, _ = load_config(str(ROOT / "experiments/configs/lm_stdlib.py:smoke"))
    results = train(config, tmp_path, log=quiet)
    assert sorted(results) == ["BP (fused)", "FDG K=2"]
    for record in results.values():
        assert record["test_perplexity"] == pytest.approx(np.exp(record["test_loss"]))
        assert record["test_bits_per_byte"] == pytest.approx(record["test_loss"] / np.log(2))
        assert record["tokens_per_second"] > 0 and record["corpus_files"] > 100
        assert record["test_loss"] < np.log(256)  # better than guessing among 256 bytes
    corpus = json.loads((tmp_path / "workdir.json").read_text())["corpus"]
    assert corpus == {k[len("corpus_") :]: v for k, v in record.items() if k.startswith("corpus_")}


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
