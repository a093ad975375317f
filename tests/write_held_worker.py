"""A training run (the small config of tests/training.py) whose checkpoint of step
`--hold` is never written: its arrays reach host memory, orbax's writes of them wait
forever, and the run trains on until the next save waits for that write. Started by
tests/test_train.py, which SIGKILLs it there."""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir")
    parser.add_argument("--hold", type=int)
    args = parser.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 4)  # as tests/conftest.py, for the same bits
    jax.config.update("jax_compilation_cache_dir", os.environ["DGRAD_TEST_JAX_CACHE"])
    import pytest
    from test_checkpoint import hold_array_writes
    from training import quiet, small_config

    from dgrad.train import train
    from dgrad.train.checkpoint import Checkpointer

    original, monkeypatch = Checkpointer.save, pytest.MonkeyPatch()

    def save(self, state, extra=None):
        if state.step == args.hold:
            hold_array_writes(monkeypatch)  # never released
        original(self, state, extra)
        print(f"saved {state.step}", flush=True)

    monkeypatch.setattr(Checkpointer, "save", save)
    train(small_config(), args.workdir, log=quiet)


if __name__ == "__main__":
    main()
