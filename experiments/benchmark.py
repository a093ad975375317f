"""Side-by-side training throughput of fused BP, staged BP, DDG and FDG.

Every configuration is built and warmed up (compiled, pipeline filled) first;
then the timed windows go round-robin over the configurations, so each round
compares them under the same machine load. The table gives medians and
[min-max] over rounds; ratios are per round against fused BP on one device.
"cores busy" is the process's CPU time over wall time; "device busy" comes from
one extra traced window per configuration (`dgrad.timeline`).

    python -m experiments.benchmark                       # ResNet-20, batch 64
    python -m experiments.benchmark --model resnet56 --batch-size 128 --stages 1,2,4
    python -m experiments.benchmark --model wrn28-10 --policies

Without an accelerator the stages run on fake CPU devices (one per stage), which
share the machine's cores.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

MODELS = {
    "resnet8": ("resnet", 8),
    "resnet20": ("resnet", 20),
    "resnet56": ("resnet", 56),
    "resnet110": ("resnet", 110),
    "wrn16-4": ("wrn", (16, 4)),
    "wrn28-10": ("wrn", (28, 10)),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet20")
    parser.add_argument("--width", type=int, default=16, help="ResNet channels of group 1")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--stages",
        default=None,
        help="comma-separated K values (default: 1..number of devices, at most 4)",
    )
    parser.add_argument(
        "--split",
        choices=["profiled", "balanced", "authors", "auto"],
        default="profiled",
        help="profiled: balance measured block times (default); balanced: multiply-adds",
    )
    parser.add_argument("--windows", type=int, default=9, help="timed rounds (default 9)")
    parser.add_argument("--steps", type=int, default=6, help="steps per timed window")
    parser.add_argument(
        "--policies",
        action="store_true",
        help="also time FDG's other weight/memory policies at the largest K",
    )
    parser.add_argument(
        "--timeline",
        metavar="DIR",
        help="write a Gantt chart (PNG) and a Perfetto trace (JSON) of each configuration",
    )
    args = parser.parse_args(argv)
    if args.stages is not None:
        args.stages = sorted({int(k) for k in args.stages.split(",")})
        if min(args.stages) < 1:
            parser.error("--stages must be positive")
    return args


def main(argv=None):
    args = parse_args(argv)
    import jax

    cpu_cores = os.cpu_count() or 1
    wanted = max(args.stages) if args.stages else min(4, max(2, cpu_cores))
    jax.config.update("jax_num_cpu_devices", wanted)
    import numpy as np
    import optax

    import dgrad
    from dgrad import balance, models
    from dgrad.timeline import Timeline

    devices = jax.devices()
    on_cpu = devices[0].platform == "cpu"
    ks = args.stages or list(range(1, min(4, len(devices)) + 1))
    if max(ks) > len(devices):
        raise SystemExit(
            f"--stages asks for {max(ks)} stages but only {len(devices)} devices exist"
        )

    kind, size = MODELS[args.model]

    def blocks():
        if kind == "resnet":
            return models.cifar_resnet_blocks(size, 10, width=args.width)
        return models.wide_resnet_blocks(*size, 10)

    rng = np.random.default_rng(0)
    images = rng.normal(size=(args.batch_size, args.image_size, args.image_size, 3))
    batch = (images.astype(np.float32), rng.integers(0, 10, args.batch_size).astype(np.int32))

    print(
        f"# dgrad benchmark: {args.model}, batch {args.batch_size}, "
        f"{args.image_size}x{args.image_size} images"
    )
    print(
        f"# {platform.node()} | {platform.processor() or platform.machine()} | {cpu_cores} "
        f"cores | {len(devices)} x {devices[0].device_kind} | jax {jax.__version__}"
    )
    if on_cpu:
        print(f"# no accelerator: {len(devices)} fake CPU devices sharing {cpu_cores} cores")

    reference_chain = blocks()
    costs = reference_chain.costs
    if args.split == "profiled":
        costs = balance.profile_blocks(reference_chain.modules, batch[0], repeats=5)
        print("# block forward+backward ms: " + " ".join(f"{1e3 * c:.1f}" for c in costs))
    split = {
        k: models.choose_cuts(
            balance.balanced_cuts(costs, k) if args.split == "profiled" else args.split,
            k,
            costs,
            reference_chain.authors,
            model=args.model,
        )
        for k in ks
    }

    def stages(k):  # fresh modules for every configuration
        return blocks().stages(k, split[k])

    ceilings = {k: balance.speedup_ceiling(costs, cuts) for k, cuts in split.items()}
    print(
        "# predicted ceiling (sum of stage costs / slowest stage): "
        + ", ".join(f"K={k}: {c:.2f}x" for k, c in ceilings.items())
    )

    optimizer = optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(0.01, momentum=0.9))
    configs = [("bp fused", 1, dict(method="bp", fused=True), devices[:1])]
    configs += [("bp staged", k, dict(method="bp"), devices[:k]) for k in ks if k > 1]
    configs += [(m, k, dict(method=m), devices[:k]) for m in ("ddg", "fdg") for k in ks]
    if args.policies:
        top = max(ks)
        configs += [
            ("fdg stash/recompute", top, dict(method="fdg", memory="recompute"), devices[:top]),
            (
                "fdg current/recompute",
                top,
                dict(method="fdg", weights="current", memory="recompute"),
                devices[:top],
            ),
        ]

    runs = []
    for name, k, options, devs in configs:
        pipe = dgrad.Pipeline(stages(k), optimizer=optimizer, devices=devs, **options)
        state = pipe.init(batch)
        for _ in range(2 * k + 2):  # compile and fill the pipeline
            state, _ = pipe.step(state, batch)
        jax.block_until_ready(state)
        runs.append(dict(name=name, k=k, pipe=pipe, state=state, rate=[], host=[], busy=[]))

    for round_ in range(args.windows):
        shift = round_ % len(runs)
        for run in runs[shift:] + runs[:shift]:
            state, pipe = run["state"], run["pipe"]
            cpu, start = time.process_time(), time.perf_counter()
            for _ in range(args.steps):
                state, _ = pipe.step(state, batch)
            dispatched = time.perf_counter() - start
            jax.block_until_ready(state)
            wall = time.perf_counter() - start
            run["state"] = state
            run["rate"].append(args.steps * args.batch_size / wall)
            run["host"].append(1e3 * dispatched / args.steps)
            run["busy"].append((time.process_time() - cpu) / wall)

    # One more window per configuration, traced: when each device was busy.
    for run in runs:
        for steps in (2, args.steps):  # a warm-up (compiles the traced variants), then the real one
            timeline = Timeline()
            with run["pipe"].trace(timeline):
                for _ in range(steps):
                    run["state"], _ = run["pipe"].step(run["state"], batch)
        run["device_busy"] = timeline.busy_fraction()
        if args.timeline:
            os.makedirs(args.timeline, exist_ok=True)
            stem = os.path.join(
                args.timeline, f"{run['name'].replace(' ', '-').replace('/', '-')}-K{run['k']}"
            )
            timeline.gantt(stem + ".png", title=f"{args.model} {run['name']} K={run['k']}")
            timeline.chrome_trace(stem + ".json")
    if args.timeline:
        print(f"# timelines written to {args.timeline}/")

    base = np.array(runs[0]["rate"])
    header = (
        f"| {'method':22s} | K | {'samples/s median [min-max]':27s} | "
        f"{'x fused BP [min-max]':20s} | {'cores busy':10s} | device busy % | host ms/step | "
        "state MiB per device |"
    )
    print()
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for run in runs:
        rate, ratio = np.array(run["rate"]), np.array(run["rate"]) / base
        memory = state_bytes_per_device(run["state"])
        print(
            f"| {run['name']:22s} | {run['k']} | "
            f"{np.median(rate):9.1f} [{rate.min():7.1f}-{rate.max():7.1f}] | "
            f"{np.median(ratio):5.2f} [{ratio.min():4.2f}-{ratio.max():4.2f}]     | "
            f"{statistics.median(run['busy']):10.2f} | "
            + f"{' '.join(f'{100 * b:.0f}' for b in run['device_busy'].values()):13s} | "
            + f"{statistics.median(run['host']):12.2f} | "
            + " ".join(f"{b / 2**20:.1f}" for b in memory.values())
            + " |"
        )
    peaks = peak_memory(devices)
    if peaks:
        print("# peak device memory MiB: " + ", ".join(f"{d}: {p:.0f}" for d, p in peaks.items()))
    return runs


def state_bytes_per_device(state) -> dict:
    """Bytes of a pipeline state (weights, optimizer, records, messages) on each device.

    A buffer held twice (a stashed copy of unchanged weights) counts once.
    """
    import jax

    totals, seen = {}, set()
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            key = (shard.device.id, shard.data.unsafe_buffer_pointer())
            if key not in seen:
                seen.add(key)
                totals[shard.device.id] = totals.get(shard.device.id, 0) + shard.data.nbytes
    return dict(sorted(totals.items()))


def peak_memory(devices) -> dict:
    """Peak bytes in use per device where the backend reports it (GPUs do, CPUs do not)."""
    peaks = {}
    for device in devices:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if stats and "peak_bytes_in_use" in stats:
            peaks[device.id] = stats["peak_bytes_in_use"] / 2**20
    return peaks


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
