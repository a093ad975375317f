"""Several processes under `jax.distributed`: starting them, and joining them.

`initialize` joins this process to a multi-process run: explicitly (coordinator address,
number of processes, this process's index) or, with `auto=True`, from what
`jax.distributed.initialize()` reads of SLURM, Open MPI or Kubernetes; on CPUs with
`cpu_devices` fake devices and gloo collectives. `launch_local` starts N such processes on
this machine, prefixes their output with the process index, forwards SIGINT / SIGTERM to
them, and when one fails stops the others and says which, so that nothing hangs. The
processes of a run agree through the coordinator's key-value store (`StopVote`,
`told_by_process_0`), making the same calls in the same order.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now.

    >>> import socket
    >>> port = free_port()
    >>> with socket.socket() as server:  # free: this process can listen on it
    ...     server.bind(("127.0.0.1", port))
    ...     server.getsockname()[1] == port
    True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    cpu_devices: int | None = None,
    auto: bool = False,
) -> None:
    """Configures JAX for this process (before it computes anything) and joins the run.

    Args:
      coordinator: `host:port` of process 0's coordination service.
      cpu_devices: fake CPU devices of this process (used only by the CPU backend).
      auto: let `jax.distributed.initialize()` read the cluster's environment.

    >>> initialize()  # no coordinator: a run of this one process, nothing to join
    >>> import jax
    >>> jax.process_count()
    1
    """
    import jax

    if cpu_devices:
        jax.config.update("jax_num_cpu_devices", int(cpu_devices))
    if coordinator is None and not auto:
        if num_processes is not None or process_id is not None:
            raise ValueError(
                "--num_processes and --process_id need --coordinator HOST:PORT (process 0's "
                "address) too, or --distributed on a cluster that JAX recognises."
            )
        return
    host, _, port = (coordinator or "").rpartition(":")
    if coordinator is not None and not (host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(
            f"--coordinator {coordinator}: give process 0's address as HOST:PORT, "
            "e.g. localhost:1234"
        )
    if coordinator is not None and (num_processes is None or process_id is None):
        raise ValueError(
            "--coordinator needs --num_processes and --process_id too (or use --distributed "
            "on a cluster that JAX recognises)."
        )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # XLA's CPU client runs every device's part of a program, and the cross-host transfers,
    # on one thread pool of as many threads as cores (or devices). A part waiting in a
    # collective for another process holds its thread, so on 2 cores two such parts starved
    # the part or the transfer the other process waited for, and runs froze. More threads
    # than can ever wait at once keep one free.
    os.environ.setdefault("PJRT_NPROC", str(max(16, 4 * int(cpu_devices or 1))))
    if not os.environ.get("JAX_CROSS_HOST_TRANSFER_SOCKET_ADDRESS"):
        jax.config.update("jax_cross_host_transfer_socket_address", _transfer_address(coordinator))
    handler = signal.getsignal(signal.SIGTERM)
    jax.distributed.initialize(coordinator, num_processes, process_id)
    if callable(handler):  # JAX's preemption notifier took SIGTERM over: give it back
        signal.signal(signal.SIGTERM, handler)


def _transfer_address(coordinator: str | None) -> str:
    """`host:port` on which this process takes the arrays other processes send it (JAX's
    cross-host transfers): the address it reaches the coordinator from, a free port."""
    host = "127.0.0.1"
    if coordinator is not None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as route:
            try:  # a UDP connect sends nothing: it only picks the interface
                route.connect((coordinator.rpartition(":")[0], 9))
                host = route.getsockname()[0]
            except OSError:
                pass
    else:
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            pass
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return f"{host}:{probe.getsockname()[1]}"


PARENT_ENV = "DGRAD_STOP_WITH_PARENT"


def child_options(**env: str) -> dict:
    """`subprocess.Popen` options for the runs a starter (a launcher, a sweep) starts: a
    session of their own, so that a Ctrl-C reaches them once (forwarded by the starter),
    and the starter's process id, which `stop_with_parent` follows. No Python runs in the
    child before exec (JAX's threads make that unsafe).

    >>> options = child_options(PYTHONUNBUFFERED="1")
    >>> options["start_new_session"], options["env"][PARENT_ENV] == str(os.getpid())
    (True, True)
    """
    return {"start_new_session": True, "env": {**os.environ, **env, PARENT_ENV: str(os.getpid())}}


def stop_with_parent(every_s: float = 0.5) -> None:
    """In a run started with `child_options`: sends this process one SIGTERM (a stop with
    a checkpoint) once the starter is gone, checked every `every_s` seconds from a daemon
    thread (Linux's PDEATHSIG would send one per dying thread, and a second stops at once).

    >>> stop_with_parent()  # this process was not started so: nothing to follow
    """
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return

    def watch():
        while os.getppid() == int(parent):
            time.sleep(every_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="dgrad-stop-with-parent", daemon=True).start()


LEAVE_S = 5.0


def leave_within(status: int, seconds: float = LEAVE_S, out=None) -> None:
    """Bounds how long this process takes to exit after a run that did not succeed
    (`status` != 0): JAX's shutdown barrier would wait 5 minutes for a peer that died or
    is stuck; after `seconds` a daemon thread prints one line and ends the process with
    `status`. After a success the peers reach the barrier too: it waits as JAX does.

    >>> leave_within(1)  # one process: no one to wait for, nothing to bound
    """
    import jax

    if jax.process_count() == 1 or status == 0:
        return
    index = jax.process_index()

    def give_up():
        time.sleep(seconds)
        try:  # a dead starter leaves no one to read it: the exit must not depend on it
            (out or sys.stderr).write(
                f"[process {index}] the other processes did not join the shutdown within "
                f"{seconds:g} s; leaving without them (exit status {status}).\n"
            )
            (out or sys.stderr).flush()
        finally:
            os._exit(status)

    threading.Thread(target=give_up, name="dgrad-leave-within", daemon=True).start()


def lost_a_peer(error: BaseException) -> bool:
    """Whether `error` is a device call failing because another process of the run went
    away (its end of a cross-process transfer closed).

    >>> lost_a_peer(RuntimeError("SocketServer: Connection closed recv() == 0."))
    True
    """
    text = str(error)
    return any(sign in text for sign in ("Connection closed", "Connection reset", "SocketServer"))


class StopVote:
    """Agrees between the processes of a run whether to stop: every process calls `any`
    at the same points of its loop with its own wish (a signal it caught), and all get the
    same answer: whether any wished to stop. The host waits for the other hosts, not for
    any device.

    >>> StopVote("run").any(False)  # one process: its own wish
    False
    """

    _opened = 0  # votes opened in this process; every process opens them in the same order

    def __init__(self, name: str, timeout_s: float = 3600.0):
        StopVote._opened += 1
        self.prefix = f"dgrad/stop/{name}/{StopVote._opened}"
        self.round = 0
        self.timeout_ms = int(timeout_s * 1000)

    def any(self, wish: bool) -> bool:
        """Whether any process of the run wishes to stop this round (every process calls it)."""
        import jax

        if jax.process_count() == 1:
            return wish
        from jax._src import distributed

        client = distributed.global_state.client
        me = jax.process_index()
        client.key_value_set(f"{self.prefix}/{self.round}/{me}", "1" if wish else "0")
        wishes = [
            client.blocking_key_value_get(f"{self.prefix}/{self.round}/{p}", self.timeout_ms)
            for p in range(jax.process_count())
        ]
        if self.round:  # every process has read the previous round before writing this one
            client.key_value_delete(f"{self.prefix}/{self.round - 1}/{me}")
        self.round += 1
        return "1" in wishes


_TOLD = itertools.count()  # calls so far; every process makes them in the same order


def told_by_process_0(name: str, message: str | None, timeout_s: float = 3600.0) -> str | None:
    """Process 0's `message` (None: nothing to report) on every process, which waits for it.

    >>> told_by_process_0("setup", "the workdir is taken")  # one process: its own message
    'the workdir is taken'
    """
    import jax

    if jax.process_count() == 1:
        return message
    from jax._src import distributed

    client, key = distributed.global_state.client, f"dgrad/told/{next(_TOLD)}/{name}"
    if jax.process_index() == 0:
        client.key_value_set(key, "" if message is None else f"!{message}")
        return message
    said = client.blocking_key_value_get(key, int(timeout_s * 1000))
    return said[1:] if said else None


def _relay(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(prefix + line)
        out.flush()


def launch_local(
    command: Sequence[str],
    processes: int,
    *,
    cpu_devices: int | None = None,
    timeout: float | None = None,
    pins: Sequence[int] | None = None,
    out=None,
) -> int:
    """Runs `command` (argv of a program taking `--coordinator`, `--num_processes`,
    `--process_id` and `--cpu_devices`) as `processes` local processes, process i pinned
    to core `pins[i]` if `pins` is given. Returns 0 if all succeeded; else the first
    failure's exit status (124 after `timeout` seconds), once the rest are stopped.

    >>> import io
    >>> show = [sys.executable, "-c", "import sys; print(sys.argv[3])"]  # prints its --process_id
    >>> out = io.StringIO()
    >>> launch_local(show, processes=2, out=out), sorted(out.getvalue().splitlines())
    (0, ['[0] --process_id=0', '[1] --process_id=1'])
    """
    out = out or sys.stdout
    coordinator = f"127.0.0.1:{free_port()}"
    children, relays = [], []
    for index in range(processes):
        argv = [
            *command,
            f"--coordinator={coordinator}",
            f"--num_processes={processes}",
            f"--process_id={index}",
        ]
        if cpu_devices:
            argv.append(f"--cpu_devices={cpu_devices}")
        if pins is not None:
            argv = pinned(argv, pins[index])
        child = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            **child_options(PYTHONUNBUFFERED="1"),
        )
        children.append(child)
        relay = threading.Thread(target=_relay, args=(child.stdout, f"[{index}] ", out))
        relay.start()
        relays.append(relay)

    forwarded = []

    def forward(number, frame):
        forwarded.append(number)
        for child in children:
            if child.poll() is None:
                child.send_signal(number)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {n: signal.signal(n, forward) for n in (signal.SIGINT, signal.SIGTERM)}
    deadline = None if timeout is None else time.monotonic() + timeout
    status = 0
    try:
        while any(child.poll() is None for child in children):
            failed = [c for c in children if c.poll() not in (None, 0)]
            if failed and not forwarded:  # (when stopping, each process saves, then exits)
                status = failed[0].returncode
                out.write(
                    f"process {children.index(failed[0])} exited with status {status}; "
                    "stopping the others\n"
                )
                break
            if deadline is not None and time.monotonic() > deadline:
                status = 124
                out.write(f"the processes ran past {timeout:g} s; stopping them\n")
                break
            time.sleep(0.1)
        else:
            codes = [child.returncode for child in children]
            status = next((code for code in codes if code), 0)
    finally:
        _stop(children)
        for relay in relays:
            relay.join(timeout=10)
        for number, handler in previous.items():
            signal.signal(number, handler)
    return status


def pinned(argv: Sequence[str], core: int) -> list[str]:
    """`argv` run pinned to `core`: a fresh Python pins itself, then becomes `argv`, so
    no Python runs between the fork and the pinning.

    >>> cores = [sys.executable, "-c", "import os; print(os.sched_getaffinity(0))"]
    >>> subprocess.run(pinned(cores, 0), capture_output=True, text=True).stdout
    '{0}\\n'
    """
    pin = (
        f"import os, sys; os.sched_setaffinity(0, {{{core}}}); os.execv(sys.argv[1], sys.argv[1:])"
    )
    return [sys.executable, "-c", pin, *argv]


def _stop(children, grace: float = 10.0) -> None:
    """Terminates the children still running, then kills what is left after `grace` s."""
    for child in children:
        if child.poll() is None:
            child.terminate()
    deadline = time.monotonic() + grace
    for child in children:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
