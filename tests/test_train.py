"""dgrad.train in this process: training every method from a config, resume bit for bit,
stopping at any moment."""

import io
import os
import signal

import jax
import numpy as np
import pytest
from damage import DAMAGES, damage, unfinish
from flax import nnx
from helpers import ROOT, assert_equal
from training import quiet, records, small_config, stop_at_call

from dgrad import data
from dgrad.options import method_title
from dgrad.train import Stopped, StopRequests, build, export, metrics, train
from dgrad.train.checkpoint import Checkpointer, state_mib
from dgrad.train.cli import load_config
from dgrad.train.config import runs_of
from dgrad.train.loop import RunContext, train_run


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, microbatches, optimizer",
    [
        ("fdg", None, "sgd"),
        pytest.param("ddg", None, "sgd", marks=pytest.mark.slow),
        pytest.param("gpipe", 4, "sgd", marks=pytest.mark.slow),
        pytest.param("1f1b", 2, "sgd", marks=pytest.mark.slow),
        pytest.param("pipedream", None, "sgd", marks=pytest.mark.slow),
        pytest.param("2bw", 2, "sgd", marks=pytest.mark.slow),
        pytest.param("fdg", None, "adamw", marks=pytest.mark.slow),
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
    run = f"{method}_k3" + (f"_m{microbatches}" if microbatches else "")
    title = f"{method_title(method)} K=3" + (f" M={microbatches}" if microbatches else "")
    assert_resumes_exactly(tmp_path, monkeypatch, config, (run, title), 13, ["10", "13"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, num_stages, virtual_stages, run",
    [
        ("zb", 3, 1, ("zb_k3_m2", "ZB-H1 K=3 M=2")),
        ("1f1b", 2, 2, ("1f1b_k2_v2_m2", "1F1B K=2 V=2 M=2")),
        ("zb", 2, 2, ("zb_k2_v2_m2", "ZB-V K=2 V=2 M=2")),
    ],
)
def test_a_stopped_zero_bubble_or_interleaved_run_resumes_to_the_same_bits(
    tmp_path, monkeypatch, method, num_stages, virtual_stages, run
):
    """ZB-H1, interleaved 1F1B and ZB-V (K*V chunks of a four-block MLP) stopped mid-run
    and resumed on the devices in reverse end as the run never stopped."""
    config = small_config(
        method=method, num_stages=num_stages, microbatches=2, virtual_stages=virtual_stages
    )
    config.model.hidden = (32, 32, 32)
    assert_resumes_exactly(tmp_path, monkeypatch, config, run, 13, ["10", "13"])


@pytest.mark.parametrize(
    "method, optimizer",
    [
        pytest.param("fdg", "adamw", marks=pytest.mark.slow),
        pytest.param("ddg", "muon", marks=pytest.mark.slow),
        pytest.param("2bw", "async_nesterov", marks=pytest.mark.slow),
        pytest.param("fdg", "sgd", marks=pytest.mark.slow),
    ],
)
def test_a_stopped_language_model_resumes_to_the_same_bits_during_its_warm_up(
    tmp_path, monkeypatch, method, optimizer
):
    """The GPT of lm_stdlib.py's smoke variant, each stage clipped, stopped at step 6 of its
    8 steps of warm-up and resumed on another layout, ends as the run never stopped."""
    config, _ = load_config(str(ROOT / "experiments/configs/lm_stdlib.py:smoke"))
    config.method, config.baseline, config.optimizer.name = method, "", optimizer
    config.log_every_steps, config.checkpoint_every_steps = 3, 5
    assert config.optimizer.warmup_epochs == 1 and config.optimizer.clip_norm == 1.0
    run = (f"{method}_k2", f"{method_title(method)} K=2")
    assert_resumes_exactly(tmp_path, monkeypatch, config, run, 6, ["5", "6"])


def assert_resumes_exactly(tmp_path, monkeypatch, config, run_and_title, stop_at, checkpoints):
    """The one run of `config`, stopped at step `stop_at` (keeping `checkpoints`) and
    resumed on the devices in reverse, writes the records and exports the model of a run
    that never stopped."""
    devices = jax.devices()[: config.num_stages]
    train(config, tmp_path / "whole", devices=devices, log=quiet)

    restore = stop_at_call(monkeypatch, stop_at)
    with pytest.raises(Stopped) as stopped:
        train(config, tmp_path / "cut", devices=devices, log=quiet)
    restore()
    assert stopped.value.checkpoint_step == stop_at
    assert stopped.value.signal_number == signal.SIGTERM
    run, title = run_and_title
    assert sorted(os.listdir(tmp_path / "cut" / run / "checkpoints")) == checkpoints
    lines = []
    train(config, tmp_path / "cut", devices=jax.devices()[::-1], log=lines.append)
    assert any(f"resumed from the checkpoint at step {stop_at}" in line for line in lines)
    assert records(tmp_path / "cut", run) == records(tmp_path / "whole", run)

    lines = []  # once more: finished, nothing is built or trained
    again = train(config, tmp_path / "cut", log=lines.append)
    assert lines == [f"{tmp_path / 'cut'} finished earlier: nothing left to train."]
    last = records(tmp_path / "cut", run)[-1]
    clock = {k: v for k, v in again[title].items() if k in metrics.CLOCK}
    assert again[title] == last | clock and "seconds" in clock
    dataset, chunks = build.load_dataset(config), runs_of(config)[0].num_stages
    stages = build.build_stages(config, chunks, dataset)
    whole = nnx.state(export.load(stages, tmp_path / "whole" / run / "model"))
    stages = build.build_stages(config, chunks, dataset)
    cut = nnx.state(export.load(stages, tmp_path / "cut" / run / "model"))
    assert_equal(cut, whole)


class _Watched:
    """A pipeline whose steps say when they were dispatched and whose losses say when the
    loop read them (a float-like value that notes the step dispatched last at its reading)."""

    def __init__(self, pipe):
        self.pipe, self.dispatched, self.reads = pipe, 0, []

    def __getattr__(self, name):
        return getattr(self.pipe, name)

    def step(self, state, batch):
        state, step_metrics = self.pipe.step(state, batch)
        self.dispatched = state.step
        if "loss" in step_metrics:
            step_metrics["loss"] = _Loss(self, state.step, step_metrics["loss"])
        return state, step_metrics


class _Loss:
    def __init__(self, watched, step, value):
        self.watched, self.step, self.value = watched, step, value

    def __float__(self):
        self.watched.reads.append((self.watched.dispatched, self.step))
        return float(self.value)


def test_the_loop_reads_a_steps_metrics_after_the_next_is_dispatched(tmp_path):
    """Only evaluation and saving (epoch ends, every 5 steps) wait for the step just
    dispatched; a log step's record (every 3) is written one step later, the same."""
    config = small_config(method="bp")
    dataset = data.load(config.dataset)
    (run,) = runs_of(config)
    pipe = build.build_pipeline(config, run, dataset, config.steps_per_epoch, jax.devices()[:2])
    example = dataset.eval_transform.apply(*dataset.train.get(np.arange(config.batch_size)), None)
    watched = _Watched(pipe)
    ctx = RunContext(
        run,
        watched,
        pipe.init(example),
        dataset,
        config.steps_per_epoch,
        str(tmp_path),
        log=quiet,
        progress_stream=io.StringIO(),
        stop=StopRequests(),
    )
    train_run(config, ctx)
    waited = sorted(latest for latest, read in watched.reads if read == latest)
    assert waited == [5, 8, 10, 15, 16]  # the save steps, epoch ends among them
    assert sorted(read for _, read in watched.reads) == list(range(1, 17))  # each read once
    logged = [r["step"] for r in metrics.read(tmp_path / "metrics.jsonl", "train")]
    assert logged == [3, 6, 8, 9, 12, 15, 16]


@pytest.mark.slow
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


@pytest.mark.slow
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
        unfinish(late)
        if killed == "before the export":
            shutil.rmtree(late / run / "model")
        else:
            (late / "curves.png").unlink()
        lines = []
        train(config, late, log=lines.append)
        assert any("finished earlier, at step 16" in line for line in lines), killed
        assert (late / "curves.png").exists() and (late / run / "model").is_dir()
        assert records(late, run) == expected
        assert_equal(exported(late), exported(tmp_path / "whole"))


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(dict(method="fr"), marks=pytest.mark.slow),
        dict(method="dgl", probe_every=4),
        pytest.param(dict(accumulate=2, probe_every=5), marks=pytest.mark.slow),
    ],
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


@pytest.fixture(scope="module")
def whole_and_cut(tmp_path_factory):
    """The small config's run, whole, and stopped at step 13 (checkpoints 10 and 13)."""
    root, config = tmp_path_factory.mktemp("damaged"), small_config()
    train(config, root / "whole", log=quiet)
    with pytest.MonkeyPatch.context() as monkeypatch:
        stop_at_call(monkeypatch, 13)
        with pytest.raises(Stopped):
            train(config, root / "cut", log=quiet)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("how", sorted(DAMAGES))
def test_a_damaged_newest_checkpoint_resumes_from_the_one_before(tmp_path, whole_and_cut, how):
    """One line names the checkpoint and what failed, one says where the run resumed; the
    damaged checkpoint is set aside, and the run ends as one that never stopped."""
    import shutil

    run, workdir = "fdg_k2", tmp_path / "cut"
    shutil.copytree(whole_and_cut / "cut", workdir)
    checkpoints = workdir / run / "checkpoints"
    damage(checkpoints / "13", how)
    lines = []
    train(small_config(), workdir, log=lines.append)
    (failed,) = [line for line in lines if "does not restore" in line]
    assert failed.startswith(f"  The checkpoint at step 13 in {checkpoints} does not restore: ")
    assert DAMAGES[how] in failed and failed.endswith(f"; set aside in {checkpoints}/damaged/13")
    resumed = "  resumed from the checkpoint at step 10 (epoch 2, 2 of 8 batches done)"
    assert f"{resumed}, the newest that restores" in lines
    assert records(workdir, run) == records(whole_and_cut / "whole", run)
    assert sorted(os.listdir(checkpoints)) == ["15", "16", "damaged"]
    assert os.listdir(checkpoints / "damaged") == ["13"]


def test_a_run_whose_checkpoints_all_fail_to_restore_is_refused_and_left_as_it_was(
    tmp_path, whole_and_cut
):
    import shutil

    from damage import snapshot

    from dgrad.train import SetupError

    run, workdir = "fdg_k2", tmp_path / "cut"
    shutil.copytree(whole_and_cut / "cut", workdir)
    checkpoints = workdir / run / "checkpoints"
    damage(checkpoints / "13", "truncated data")
    damage(checkpoints / "10", "corrupt meta")
    before = snapshot(workdir / run)
    lines = []
    with pytest.raises(SetupError) as refused:
        train(small_config(), workdir, log=lines.append)
    message = str(refused.value)
    assert message.startswith(f"No checkpoint in {checkpoints} restores (step 13: OUT_OF_RANGE")
    assert "; step 10: its meta: JSONDecodeError" in message and "\n" not in message
    assert not [line for line in lines if "restore" in line]
    assert snapshot(workdir / run) == before


def test_every_record_says_its_pace_and_where_the_epoch_s_time_went(tmp_path):
    """Train records: seconds per step and samples per second between records, the time
    spent evaluating and saving left out; epoch records: their seconds split into
    training, evaluation and checkpoints, and the MiB of the checkpoint saved at its end."""
    config = small_config(keep_checkpoints=10)
    train(config, tmp_path, log=quiet)
    written = metrics.read(tmp_path / "fdg_k2" / "metrics.jsonl")
    steps = [r for r in written if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [3, 6, 8, 9, 12, 15, 16]
    for record in steps:
        assert record["step_seconds"] > 0 and "tokens_per_second" not in record
        assert record["samples_per_second"] == pytest.approx(
            config.batch_size / record["step_seconds"]
        )
    epochs = [r for r in written if r["kind"] == "epoch"]
    for record in epochs:
        parts = ("train_seconds", "eval_seconds", "checkpoint_seconds")
        assert all(record[part] >= 0 for part in parts) and record["eval_seconds"] > 0
        assert sum(record[part] for part in parts) == pytest.approx(record["seconds"])
    first, second = epochs
    assert first["checkpoint_seconds"] > 0  # the save at step 5
    assert second["checkpoint_seconds"] > 0  # the epoch end's save at 8, and 10 and 15
    dataset, (run,) = data.load(config.dataset), runs_of(config)
    pipe = build.build_pipeline(config, run, dataset, config.steps_per_epoch, jax.devices())
    example = dataset.eval_transform.apply(*dataset.train.get(np.arange(config.batch_size)), None)
    pipe.init(example)
    with Checkpointer(tmp_path / "fdg_k2" / "checkpoints") as checkpoints:
        saved = [checkpoints.restore(pipe, step)[0] for step in (8, 16)]
    assert [record["checkpoint_mib"] for record in epochs] == [
        round(state_mib(state), 2)
        for state in saved  # each epoch end's checkpoint
    ]
    weights = sum(a.nbytes for a in jax.tree.leaves([s.params for s in saved[1].stages]))
    assert second["checkpoint_mib"] > weights / 2**20  # FDG keeps records and messages too


def test_with_peak_tflops_every_train_record_says_its_mfu(tmp_path):
    """MFU = the step's model FLOPs over its seconds and the peak of the run's two devices:
    the same FLOPs behind every record."""
    config = small_config()
    config.peak_tflops = 1e-3
    train(config, tmp_path, log=quiet)
    steps = metrics.read(tmp_path / "fdg_k2" / "metrics.jsonl", "train")
    flops = [r["mfu"] * r["step_seconds"] * 2 * 1e12 * config.peak_tflops for r in steps]
    assert flops[0] > 0 and flops == pytest.approx([flops[0]] * len(flops))


@pytest.mark.slow
def test_a_run_killed_while_a_checkpoint_is_written_resumes_from_the_one_before(
    tmp_path, whole_and_cut
):
    """SIGKILL while the checkpoint of step 10 is written in the background, after steps
    11 to 15 ran beside the write: what orbax wrote of it stays a temporary directory;
    the run resumes from step 8, redoes the steps after it and ends as one that never
    stopped."""
    import subprocess
    import sys
    import tempfile
    import time

    from helpers import ROOT
    from processes import kill_tree

    run, workdir = "fdg_k2", tmp_path / "run"
    checkpoints = workdir / run / "checkpoints"
    worker = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "write_held_worker.py"), f"--workdir={workdir}"]
        + ["--hold=10"],
        cwd=ROOT,
        env={
            "DGRAD_TEST_JAX_CACHE": os.path.join(tempfile.gettempdir(), "dgrad-test-jax-cache"),
            **os.environ,
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    metrics_path = workdir / run / "metrics.jsonl"
    while worker.poll() is None and time.monotonic() < deadline:
        if metrics_path.exists() and any(r["step"] == 15 for r in metrics.read(metrics_path)):
            break  # steps 11-15 done, the save at 15 waiting for 10's write
        time.sleep(0.05)
    alive = worker.poll() is None
    kill_tree(worker.pid)
    output, _ = worker.communicate()
    assert alive, f"the worker ended before its kill:\n{output[-3000:]}"
    assert "saved 10" in output and "saved 15" not in output, output[-3000:]
    assert sorted(os.listdir(checkpoints)) == ["10.orbax-checkpoint-tmp", "5", "8"]

    lines = []
    train(small_config(), workdir, log=lines.append)
    assert not [line for line in lines if "does not restore" in line], lines
    assert "  resumed from the checkpoint at step 8 (epoch 2, 0 of 8 batches done)" in lines
    assert records(workdir, run) == records(whole_and_cut / "whole", run)
    assert sorted(os.listdir(checkpoints)) == ["15", "16"]
