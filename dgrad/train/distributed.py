"""Several processes under `jax.distributed`: joining them, and agreeing between them.

`initialize` joins this process to a multi-process run: explicitly (coordinator address,
number of processes, this process's index) or, with `auto=True`, from what
`jax.distributed.initialize()` reads of SLURM, Open MPI or Kubernetes; on CPUs with
`cpu_devices` fake devices and gloo collectives (`dgrad.train.supervisor.launch_local`
starts N such processes on this machine). The processes of a run agree through the
coordinator's key-value store (`StopVote`, `told_by_process_0`), making the same calls in
the same order.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import sys
import threading
import time


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
