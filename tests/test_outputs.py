"""What a run leaves behind: the merged model, metrics files, TensorBoard, the progress bar."""

import io

import jax
import numpy as np
import pytest
from helpers import batches, build_pipeline, build_stages

from dgrad.train import export, metrics
from dgrad.train.progress import Progress


@pytest.mark.parametrize("method", ["fdg", pytest.param("ddg", marks=pytest.mark.slow)])
def test_merged_model_predicts_like_the_pipeline(tmp_path, method):
    data = batches("cnn", 7)
    pipe = build_pipeline("cnn", 3, method=method, devices=jax.devices()[1:4])
    state = pipe.init(data[0])
    for batch in data:
        state, _ = pipe.step(state, batch)
    model = export.merge(pipe, state, device=jax.devices()[0])
    outputs = model(data[0][0])
    assert outputs.devices() == {jax.devices()[0]}
    np.testing.assert_allclose(
        np.asarray(outputs), np.asarray(pipe.predict(state, data[0][0])), rtol=1e-6, atol=1e-6
    )
    # BatchNorm statistics came along (the initial stages have other ones).
    fresh = export.merge(pipe, pipe.init(data[0]))
    assert not np.allclose(np.asarray(fresh(data[0][0])), np.asarray(outputs))

    path = export.save(model, tmp_path / "model")
    loaded = export.load(build_stages("cnn", 3), path)
    np.testing.assert_array_equal(np.asarray(loaded(data[0][0])), np.asarray(outputs))


def test_metric_writer_feeds_tensorboard(tmp_path):
    with metrics.MetricWriter(tmp_path / "m.jsonl", tensorboard_dir=str(tmp_path / "tb")) as w:
        assert w.has_tensorboard
        w.write({"kind": "epoch", "step": 4, "epoch": 1, "test_accuracy": 0.5})
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert metrics.read(tmp_path / "m.jsonl") == [
        {"kind": "epoch", "step": 4, "epoch": 1, "test_accuracy": 0.5}
    ]


def test_curves_png_leaves_the_global_backend_alone(tmp_path):
    import matplotlib

    backend = matplotlib.get_backend()
    records = [{"epoch": e, "train_loss": 1 / e, "test_accuracy": e / 4} for e in (1, 2, 3)]
    path = metrics.plot_curves(
        {"FDG K=2": records, "BP": records}, tmp_path / "curves.png", title="default: digits"
    )
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.get_backend() == backend


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_on_a_terminal_is_tqdm():
    out = Terminal()
    progress = Progress(total=10, start=0, batch_size=8, stream=out, label="fdg_k2 ")
    for step in range(1, 11):
        progress.update(step, loss=0.5)
    progress.close()
    text = out.getvalue()
    assert "\r" in text and text.endswith("\n") and text.count("\n") == 1  # one line, redrawn
    assert "fdg_k2" in text and "100%" in text and "sample/s" in text and "loss=0.5000" in text


def test_progress_lines_elsewhere_come_every_few_steps():
    out = io.StringIO()
    progress = Progress(total=10, start=2, batch_size=8, stream=out, every=4)
    for step in range(3, 11):
        progress.update(step)
    assert [line.split()[1] for line in out.getvalue().splitlines()] == ["4/10", "8/10", "10/10"]
    assert "ETA" in out.getvalue()
