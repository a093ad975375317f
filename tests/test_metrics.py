"""dgrad.train.metrics: the metrics files, TensorBoard and the curves."""

from dgrad.train import metrics


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
