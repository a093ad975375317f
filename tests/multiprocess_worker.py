"""One process of a multi-process test run, started by tests/test_distributed.py.

Trains the test CNN, K = 2 stages x D = 2 replicas, on 2 processes of 2 fake CPU
devices: layout `a` (every process holds every stage, replicas span the processes)
or `b` (stage k on process k). Optionally restores a checkpoint first and saves one
after `--save_at` steps; process 0 writes the final weights and losses to `--out`.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    parser = argparse.ArgumentParser()
    for name in ("--coordinator", "--out", "--save_dir", "--restore_dir", "--layout"):
        parser.add_argument(name)
    for name in ("--num_processes", "--process_id", "--cpu_devices", "--steps", "--save_at"):
        parser.add_argument(name, type=int)
    parser.add_argument("--method", default="fdg")
    args = parser.parse_args()

    from dgrad.train import distributed

    distributed.initialize(
        args.coordinator, args.num_processes, args.process_id, cpu_devices=args.cpu_devices
    )
    import jax
    import numpy as np
    from helpers import SMOOTH_OPTIMIZER, batches, build_pipeline

    from dgrad.placement import share
    from dgrad.train.checkpoint import Checkpointer

    placement = {"a": "interleaved", "b": "spread"}[args.layout]
    pipe = build_pipeline(
        "cnn",
        2,
        method=args.method,
        optimizer=SMOOTH_OPTIMIZER,
        data_parallel=2,
        placement=placement,
        record_sources=True,  # as the training command: checkpoints forward records again
    )
    owners = [sorted({d.process_index for d in group}) for group in pipe.placement.groups]
    print(f"stage groups by process: {owners}", flush=True)
    data = batches("cnn", args.steps)
    state = pipe.init(data[0])
    if args.restore_dir:
        with Checkpointer(args.restore_dir) as checkpoints:
            state, _ = checkpoints.restore(pipe)
    losses = []
    for t in range(state.step, args.steps):
        state, metrics = pipe.step(state, data[t])
        losses.append(share(metrics["loss"]) if metrics else None)
        if args.save_dir and state.step == args.save_at:
            jax.block_until_ready(losses)  # no gather in flight meets orbax's barriers
            with Checkpointer(args.save_dir) as checkpoints:
                checkpoints.save(state)
    params = share([s.params for s in state.stages])
    rests = share([s.rest for s in state.stages])
    if jax.process_index() == 0:
        leaves = jax.tree.leaves((params, rests))
        np.savez(
            args.out,
            losses=np.array([np.nan if loss is None else float(loss) for loss in losses]),
            **{f"leaf{i}": np.asarray(leaf) for i, leaf in enumerate(leaves)},
        )
    print("done", flush=True)


if __name__ == "__main__":
    main()
