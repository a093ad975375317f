"""dgrad.train.loop's bookkeeping: the tally, the pace, metrics one step behind, what is due."""

import math

import jax.numpy as jnp

from dgrad.train.loop import Due, TrainMetrics, due_after, text_metrics


def metrics_of(records=None, **kwargs):
    writer = None if records is None else Writer(records)
    return TrainMetrics(writer, start=kwargs.pop("start", 0), per_step=32, **kwargs)


class Writer:
    def __init__(self, records):
        self.write = records.append


def test_device_values_are_read_once_and_what_is_no_metric_left_out():
    metrics = metrics_of()
    metrics.hold({})  # FDG while filling: nothing reported, nothing counted
    assert metrics.read() is None and metrics.saved() == {"epoch": {}, "interval": {}}
    metrics.hold({"loss": jnp.array(0.5), "batch": 7, "probe": {}, "probe_step": 3})
    assert (metrics.read(), metrics.read()) == (0.5, None)
    sums = {"loss": 0.5, "count": 1}
    assert metrics.saved() == {"epoch": sums, "interval": sums}


def test_a_record_holds_the_interval_s_mean_once_and_a_checkpoint_carries_the_sums():
    records = []
    metrics = metrics_of(records)
    for step, loss in enumerate((1.0, 3.0), start=1):
        metrics.hold({"loss": loss}, log_at=step if step == 2 else None)
        metrics.read()
    metrics.hold({}, log_at=3)  # nothing since the last record: none written
    metrics.read()
    assert [(r["step"], r["loss"]) for r in records] == [(2, 2.0)]
    metrics.hold({"loss": 5.0})
    metrics.read()
    resumed = metrics_of(records, start=3, saved=metrics.saved())
    resumed.hold({}, log_at=4)
    resumed.read()
    assert (records[-1]["step"], records[-1]["loss"]) == (4, 5.0)
    assert (resumed.take_epoch(), resumed.take_epoch()) == ({"train_loss": 3.0}, {})


def test_the_pace_leaves_out_paused_time_and_names_its_unit():
    records = []
    metrics = metrics_of(records, start=8, unit="token")
    metrics.begin -= 40.0  # as if the 4 steps to come took 40 s ...
    metrics.pause(20.0)  # ... half of them evaluating
    metrics.hold({"loss": 1.0}, log_at=12)
    metrics.read()
    assert sorted(records[0]) == ["kind", "loss", "step", "step_seconds", "tokens_per_second"]
    assert math.isclose(records[0]["step_seconds"], 5.0, rel_tol=1e-3)
    assert math.isclose(records[0]["tokens_per_second"], 32 / 5.0, rel_tol=1e-3)
    assert metrics.paused == 0.0


def test_the_pace_gives_the_mfu_only_with_flops_and_a_peak():
    for flops, peak, mfu in ((2e12, 1e12, 0.2), (2e12, 0.0, None)):
        records = []
        metrics = metrics_of(records, flops=flops, peak_flops=peak)
        metrics.begin -= 40.0  # 4 steps of 10 s: 0.2 TFLOP/s of a peak of 1
        metrics.hold({"loss": 1.0}, log_at=4)
        metrics.read()
        if mfu is None:
            assert "mfu" not in records[0]
        else:
            assert math.isclose(records[0]["mfu"], mfu, rel_tol=1e-3)


def test_the_probe_s_records_are_written_when_its_step_is_read():
    records = []
    metrics = metrics_of(records)
    probe = {0: {"cosine": jnp.array(0.5)}, 1: {"cosine": 0.25}}
    metrics.hold({"loss": 1.0, "batch": 0, "probe": probe, "probe_step": 0}, log_at=1)
    metrics.read()
    assert records[:2] == [
        {"kind": "probe", "step": 1, "stage": 0, "cosine": 0.5},
        {"kind": "probe", "step": 1, "stage": 1, "cosine": 0.25},
    ]
    assert records[2]["kind"] == "train" and "probe" not in records[2]


def test_what_is_due_after_a_step():
    every = dict(steps_per_epoch=10, log_every=4, checkpoint_every=3)
    assert due_after(8, **every) == Due(log=True, evaluate=False, save=False)
    assert due_after(6, **every) == Due(log=False, evaluate=False, save=True)
    assert due_after(10, **every) == Due(log=False, evaluate=True, save=True)
    assert due_after(9, **dict(every, checkpoint_every=0)) == Due(False, False, False)


def test_a_stop_is_asked_every_step_on_one_process_and_only_where_something_is_due_on_several():
    asked = []

    def agreed():
        asked.append(True)
        return True

    every = dict(steps_per_epoch=10, log_every=50, checkpoint_every=3, stop_agreed=agreed)
    assert due_after(7, **every, agree_every_step=False) == Due(False, False, False, stop=False)
    assert asked == []
    assert due_after(6, **every, agree_every_step=False).stop and len(asked) == 1
    assert due_after(7, **every).stop and len(asked) == 2


def test_text_metrics_are_per_token_and_per_byte():
    units = text_metrics({"test_loss": math.log(4), "seconds": 2.0}, 1000, {"python": "3.11.7"})
    assert math.isclose(units["test_perplexity"], 4.0) and math.isclose(
        units["test_bits_per_byte"], 2.0
    )
    assert units["tokens_per_second"] == 500.0 and units["corpus_python"] == "3.11.7"
    bpe = {"test_tokens": 250, "test_bytes": 1000}  # 4 bytes a token: a quarter of the bits
    assert (
        text_metrics({"test_loss": math.log(16), "seconds": 1.0}, 10, bpe)["test_bits_per_byte"]
        == 1.0
    )
