"""Runs `python -m experiments.train` on many argument lists, importing it only once.

    python tests/cli_worker.py CASES.json RESULTS.json

CASES.json holds a list of argument lists; RESULTS.json gets, for each, the exit status
and what the command printed (its stdout and stderr, as file descriptors 1 and 2 saw
them). Each command runs in a process forked from this one after the imports, before
JAX has started a backend: a fresh process as the command line would start, less the
second or two of importing JAX, Flax and dgrad.
"""

import json
import os
import sys
import tempfile
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dgrad.train.cli import main  # noqa: E402

DEFAULT_CONFIG = os.path.join(ROOT, "experiments/configs/default.py")


def run(argv: list[str]) -> dict:
    """The status and output of the command with `argv`, run in a forked process."""
    with tempfile.TemporaryFile("w+") as printed:
        pid = os.fork()
        if pid == 0:
            os.dup2(printed.fileno(), 1)
            os.dup2(printed.fileno(), 2)
            status = 1
            try:
                status = main(argv, default_config=DEFAULT_CONFIG)
            except BaseException:  # noqa: BLE001 (printed as Python would, status 1)
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        _, wait_status = os.waitpid(pid, 0)
        printed.seek(0)
        return {"status": os.waitstatus_to_exitcode(wait_status), "output": printed.read()}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    results = [run(argv) for argv in cases]
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)
