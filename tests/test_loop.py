"""dgrad.train.loop's bookkeeping: the tally, the pace, metrics one step behind, what is due."""

import math

import jax.numpy as jnp

from dgrad.train.loop import Behind, Due, Pace, Tally, due_after, text_metrics


class Records(list):
    write = list.append


def test_the_tally_reads_device_values_and_leaves_out_what_is_no_metric():
    tally = Tally()
    assert tally.add({}) == {}  # FDG while filling: nothing reported, nothing counted
    reported = {"loss": jnp.array(0.5), "batch": 7, "probe": {}, "probe_step": 3}
    assert tally.add(reported) == {"loss": 0.5}
    assert tally.saved() == {
        "epoch": {"loss": 0.5, "count": 1},
        "interval": {"loss": 0.5, "count": 1},
    }


def test_the_interval_and_the_epoch_are_means_taken_once_and_carried_by_a_checkpoint():
    tally = Tally()
    for loss in (1.0, 3.0):
        tally.add({"loss": loss})
    assert (tally.take_interval(), tally.take_interval()) == ({"loss": 2.0}, {})
    tally.add({"loss": 5.0})
    resumed = Tally(tally.saved())
    assert resumed.take_interval() == {"loss": 5.0}
    assert (resumed.take_epoch(), resumed.take_epoch()) == ({"train_loss": 3.0}, {})


def test_the_pace_leaves_out_paused_time_and_names_its_unit():
    pace = Pace(start=8, per_step=64, unit="token")
    assert pace.take(8) == {}  # no step since the start
    pace.begin -= 40.0  # as if the 4 steps to come took 40 s ...
    pace.pause(20.0)  # ... half of them evaluating
    taken = pace.take(12)
    assert sorted(taken) == ["step_seconds", "tokens_per_second"]
    assert math.isclose(taken["step_seconds"], 5.0, rel_tol=1e-3)
    assert pace.paused == 0.0 and pace.take(12) == {}


def test_the_pace_gives_the_mfu_only_with_flops_and_a_peak():
    pace = Pace(start=0, per_step=32, flops=2e12, peak_flops=1e12)
    pace.begin -= 40.0  # 4 steps of 10 s: 0.2 TFLOP/s of a peak of 1
    assert math.isclose(pace.take(4)["mfu"], 0.2, rel_tol=1e-3)
    pace = Pace(start=0, per_step=32, flops=2e12)
    pace.begin -= 1.0
    assert "mfu" not in pace.take(1)


def test_metrics_are_read_once_after_the_next_step_and_a_due_record_written_then():
    behind = Behind(Tally(), Records())
    behind.hold({"loss": 2.0, "batch": 0}, log_at=1)
    assert behind.writer == []  # nothing read while the step may still run
    assert (behind.read(), behind.read()) == (2.0, None)
    assert behind.writer == [{"kind": "train", "step": 1, "loss": 2.0}]
    behind.hold({})  # FDG while filling
    assert behind.read() is None and len(behind.writer) == 1


def test_a_train_record_carries_the_pace_and_the_probe_its_own_records():
    behind = Behind(Tally(), Records(), Pace(start=0, per_step=8))
    probe = {0: {"cosine": jnp.array(0.5)}}
    behind.hold({"loss": 1.0, "batch": 0, "probe": probe, "probe_step": 0}, log_at=1)
    behind.read()
    probe_record, train_record = behind.writer
    assert probe_record == {"kind": "probe", "step": 1, "stage": 0, "cosine": 0.5}
    assert sorted(train_record) == ["kind", "loss", "samples_per_second", "step", "step_seconds"]


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
