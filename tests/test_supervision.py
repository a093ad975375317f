"""Stop requests, the watchdog's limits, the launcher's processes and the workdir's lock."""

import io
import json
import os
import signal
import sys
import threading
import time

import pytest

from dgrad.train import config as fields
from dgrad.train.distributed import StopVote, initialize, lost_a_peer
from dgrad.train.signals import Stopped, StopRequests
from dgrad.train.supervisor import launch_local
from dgrad.train.watchdog import AUTO_FIRST_S, AUTO_FLOOR_S, Watchdog
from dgrad.train.workdir import STATE_FILE, WorkdirError, create, finish, hold, inspect


def test_a_stop_request_is_a_sigterm_unless_named_and_exits_with_128_plus_its_number():
    stop = StopRequests()
    assert stop.requested is None and stop.exit_status() == 128
    stop.request()
    assert stop.requested == signal.SIGTERM and stop.exit_status() == 143
    stop.request(signal.SIGINT)
    assert stop.exit_status() == 130


def test_checking_for_a_stop_returns_until_one_is_asked_for_then_raises_stopped():
    stop = StopRequests()
    assert stop.check("compiling") is None
    stop.request()
    with pytest.raises(Stopped) as stopped:
        stop.check("compiling")
    assert str(stopped.value) == "Stopped while compiling, before training; nothing saved."
    assert stopped.value.signal_number == signal.SIGTERM
    assert stopped.value.checkpoint_step is None


def test_stop_requests_take_the_signals_only_inside_and_only_on_the_main_thread():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequests() as stop:
        assert signal.getsignal(signal.SIGTERM) == stop._handle
    assert signal.getsignal(signal.SIGTERM) == before
    seen = []

    def elsewhere():
        with StopRequests() as stop:
            seen.append(signal.getsignal(signal.SIGTERM))
            stop.request()  # the flag still works
            seen.append(stop.requested)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert seen == [before, signal.SIGTERM]


def test_a_beat_records_the_step_and_a_beat_without_one_keeps_it():
    watchdog = Watchdog()
    watchdog.beat(7)
    watchdog.beat()  # an evaluation batch
    assert watchdog.step == 7


def test_the_automatic_stall_limit_follows_the_slowest_step():
    watchdog = Watchdog()  # -1: follows the run
    assert watchdog.limit_s() == AUTO_FIRST_S  # nothing finished yet: the compiling step
    watchdog.beat(1)
    watchdog.slowest_s = 60.0
    assert watchdog.limit_s() == 600.0  # ten times the slowest step
    watchdog.slowest_s = 1.0
    assert watchdog.limit_s() == AUTO_FLOOR_S
    assert Watchdog(stall_timeout=0).limit_s() is None
    assert Watchdog(stall_timeout=5).limit_s() == 5.0


def test_the_grace_after_a_signal_is_twice_the_slowest_step_when_that_is_longer():
    watchdog = Watchdog(grace_s=5.0)
    assert watchdog.grace_after_signal_s() == 5.0
    watchdog.slowest_s = 4.0
    assert watchdog.grace_after_signal_s() == 8.0


def test_a_save_pauses_the_watch_and_counts_as_progress_at_its_end():
    watchdog = Watchdog()
    with watchdog.saving():
        assert watchdog._saving
        before = time.monotonic()
    assert not watchdog._saving and watchdog._last >= before


def test_an_exit_waits_for_a_checkpoint_being_written_only_while_it_is_written():
    watchdog = Watchdog(write_wait_s=0.3)
    assert watchdog._wait_for_write() < 0.05  # told of no write
    watchdog.watch_writes(lambda: False)
    assert watchdog._wait_for_write() < 0.05
    watchdog.watch_writes(lambda: True)  # never done: waits its bound
    assert 0.3 <= watchdog._wait_for_write() < 1.0

    def closed():
        raise RuntimeError("the checkpointer is closed")

    watchdog.watch_writes(closed)
    assert watchdog._wait_for_write() < 0.05


def test_process_counts_and_indices_without_a_coordinator_are_one_line():
    with pytest.raises(ValueError, match=r"--num_processes and --process_id need --coordinator"):
        initialize(num_processes=2)
    with pytest.raises(ValueError, match=r"--coordinator needs --num_processes and --process_id"):
        initialize("localhost:1234")


def test_only_a_closed_connection_counts_as_a_lost_peer():
    assert lost_a_peer(RuntimeError("Connection reset by peer"))
    assert not lost_a_peer(RuntimeError("RESOURCE_EXHAUSTED: out of memory"))


def test_a_vote_of_one_process_is_its_own_wish_round_by_round():
    vote = StopVote("test")
    assert [vote.any(False), vote.any(True), vote.any(False)] == [False, True, False]


def test_a_launched_process_that_fails_stops_the_others_and_gives_its_status():
    fail = [  # process 1 fails at once, process 0 would wait a minute
        sys.executable,
        "-c",
        "import sys, time; time.sleep(0 if sys.argv[3].endswith('1') else 60); sys.exit(3)",
    ]
    out = io.StringIO()
    started = time.monotonic()
    assert launch_local(fail, processes=2, out=out) == 3
    assert out.getvalue() == "process 1 exited with status 3; stopping the others\n"
    assert time.monotonic() - started < 30


def test_launched_processes_past_their_timeout_are_stopped_with_status_124():
    wait = [sys.executable, "-c", "import time; time.sleep(60)"]
    out = io.StringIO()
    assert launch_local(wait, processes=2, timeout=0.5, out=out) == 124
    assert out.getvalue() == "the processes ran past 0.5 s; stopping them\n"


def test_launched_processes_run_on_the_cores_they_are_pinned_to():
    cores = [sys.executable, "-c", "import os; print(os.sched_getaffinity(0))"]
    out = io.StringIO()
    assert launch_local(cores, processes=2, pins=[0, 0], out=out) == 0
    assert sorted(out.getvalue().splitlines()) == ["[0] {0}", "[1] {0}"]


def test_a_workdir_s_lock_is_free_again_after_the_with_block(tmp_path):
    with hold(tmp_path):
        pass
    with hold(tmp_path):  # the lock file stays, free
        with pytest.raises(WorkdirError, match="another command is training in"):
            with hold(tmp_path):
                pass


def test_a_directory_of_other_files_is_no_workdir(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(WorkdirError, match="holds files but no workdir.json, so it is not a dgrad"):
        inspect(tmp_path, fields.base())
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(WorkdirError, match="was started by an older dgrad .*; train it with the"):
        inspect(tmp_path, fields.base())


def test_extending_needs_a_trained_experiment_and_more_epochs(tmp_path):
    config = fields.base()
    trained = config.num_epochs
    with pytest.raises(WorkdirError, match="--extend needs a trained experiment"):
        inspect(tmp_path, config, extend=True)
    create(inspect(tmp_path, config), config)
    # as many epochs: an extension that was stopped resumes
    assert inspect(tmp_path, config, extend=True).extends_from is None
    config.num_epochs = trained - 1
    with pytest.raises(WorkdirError, match=f"above the {trained} it was trained for"):
        inspect(tmp_path, config, extend=True)
    config.num_epochs = trained + 1
    with pytest.raises(WorkdirError, match=r"num_epochs .*\(to train it longer, add --extend\)"):
        inspect(tmp_path, config)
    assert inspect(tmp_path, config, extend=True).extends_from == trained


def test_the_workdir_json_holds_the_config_the_corpus_and_the_epochs_finished(tmp_path):
    config, corpus = fields.base(), {"python": "3.11.9", "sha256": "1f0e"}
    create(inspect(tmp_path, config), config, corpus)
    state = json.loads((tmp_path / STATE_FILE).read_text())
    assert state == {"config": state["config"], "corpus": corpus, "finished_epochs": None}
    plan = inspect(tmp_path, config)
    assert plan.resumes and plan.corpus == corpus and plan.finished is None
    assert plan.saved["num_stages"] == config.num_stages
    finish(plan, config)
    assert inspect(tmp_path, config).finished == config.num_epochs
    config.num_epochs += 1  # an extension keeps the epochs finished until it finishes
    create(inspect(tmp_path, config, extend=True), config, corpus)
    assert inspect(tmp_path, config).finished == config.num_epochs - 1
    assert sorted(os.listdir(tmp_path)) == [STATE_FILE]  # no temporary file left


def test_the_supervisor_forwards_each_signal_once_to_each_child_also_one_started_after():
    """A child counts the SIGTERMs it gets for 2 s, then prints the count: one started after
    the signal gets it too, at the next poll, and none gets it twice however often it polls."""
    import signal

    from dgrad.train.supervisor import Supervisor

    count = (
        "import signal, sys, time; got = []; signal.signal(signal.SIGTERM, lambda *a: "
        "got.append(1)); print('ready', flush=True); time.sleep(2); print(len(got))"
    )
    out = io.StringIO()
    with Supervisor(out) as children:
        first = children.start([sys.executable, "-c", count], prefix="[first] ")
        while "ready" not in out.getvalue():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # to this process: the supervisor takes it
        assert children.stopped == [signal.SIGTERM]
        children.start([sys.executable, "-c", count], prefix="[late] ")
        while "[late] ready" not in out.getvalue():  # (only `poll` sends: none sent yet)
            time.sleep(0.05)
        while len(children.poll()) > 0:  # (each poll forwards what is not yet sent)
            time.sleep(0.05)
    lines = sorted(line for line in out.getvalue().splitlines() if "ready" not in line)
    assert lines == ["[first] 1", "[late] 1"], out.getvalue()
    assert first.returncode == 0
