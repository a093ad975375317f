"""Train a stage-split model with BP, DDG or FDG and report test accuracy.

The default trains a small CIFAR-style ResNet on scikit-learn's digits (offline)
with FDG on two stages and with fused backprop, side by side:

    python -m experiments.train
    python -m experiments.train --methods ddg,fdg --stages 3 --beta 0.5 --epochs 10

On a machine without accelerators the stages run on fake CPU devices, one per
stage (the two CPU cores then really work in parallel).
"""

from __future__ import annotations

import argparse
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--methods",
        default="bp,fdg",
        help="comma-separated methods to train, from bp, ddg, fdg (default bp,fdg)",
    )
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages K (default 2)")
    parser.add_argument("--beta", type=float, default=1.0, help="FDG gradient shrinking (0, 1]")
    parser.add_argument("--model", choices=["resnet", "mlp"], default="resnet")
    parser.add_argument("--depth", type=int, default=8, help="ResNet depth 6n+2 (default 8)")
    parser.add_argument("--width", type=int, default=8, help="ResNet channels of group 1")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--weights", choices=["stash", "current"], default="stash")
    parser.add_argument("--memory", choices=["residuals", "recompute"], default="residuals")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.stages < 1:
        parser.error(f"--stages must be at least 1, got {args.stages}")
    return args


def main(argv=None) -> dict[str, float]:
    args = parse_args(argv)
    import jax

    # Fake CPU devices only matter when JAX falls back to the CPU.
    jax.config.update("jax_num_cpu_devices", max(args.stages, 1))
    import numpy as np
    import optax

    import dgrad
    from dgrad import data, models

    devices = jax.devices()
    if devices[0].platform == "cpu":
        print(
            f"No accelerator found: running {args.stages} stage(s) on "
            f"{len(devices)} fake CPU devices."
        )
    train, test = data.load_digits(seed=args.seed)
    steps_per_epoch = len(train.labels) // args.batch_size
    optimizer = optax.chain(
        optax.add_decayed_weights(args.weight_decay),
        optax.sgd(optax.cosine_decay_schedule(args.lr, args.epochs * steps_per_epoch), 0.9),
    )

    def build(num_stages):
        if args.model == "mlp":
            return models.mlp([64, 128, 128, 10], num_stages=num_stages, rngs=args.seed)
        return models.cifar_resnet(
            args.depth,
            10,
            num_stages,
            width=args.width,
            in_channels=1,
            split="balanced",
            rngs=args.seed,
        )

    results = {}
    for method in args.methods:
        fused = method == "bp"
        pipe = dgrad.Pipeline(
            build(1 if fused else args.stages),
            method=method,
            optimizer=optimizer,
            beta=args.beta if method == "fdg" else 1.0,
            weights=args.weights,
            memory=args.memory,
            devices=devices[:1] if fused else devices,
            fused=fused,
        )
        label = "BP (fused, 1 device)" if fused else f"{method.upper()} K={args.stages}"
        print(f"\n{label}: {pipe}")
        state = pipe.init(next(data.batches(train, args.batch_size)))
        for epoch in range(args.epochs):
            start, losses, previous = time.perf_counter(), [], None
            for batch in data.batches(train, args.batch_size, seed=args.seed * 1000 + epoch):
                state, metrics = pipe.step(state, batch)
                # Read the previous step's loss only after this step is dispatched.
                if previous:
                    losses.append(float(previous["loss"]))
                previous = metrics
            if previous:
                losses.append(float(previous["loss"]))
            pipe.check_finite(state)
            accuracy = evaluate(pipe, state, test, args.batch_size)
            seconds = time.perf_counter() - start
            print(
                f"  epoch {epoch + 1:3d}  train loss {np.mean(losses):.4f}  "
                f"test accuracy {accuracy:.4f}  {steps_per_epoch * args.batch_size / seconds:7.0f} "
                "samples/s",
                flush=True,
            )
        results[label] = accuracy
    print("\nTest accuracy:")
    for label, accuracy in results.items():
        print(f"  {label:24s} {accuracy:.4f}")
    return results


def evaluate(pipe, state, split, batch_size) -> float:
    from dgrad import data

    correct = []
    for x, y in data.batches(split, batch_size, drop_remainder=False):
        correct.append(pipe.evaluate(state, (x, y))["accuracy"] * len(y))
    return float(sum(correct)) / len(split.labels)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
