"""The benchmark command's tables (`python -m experiments.benchmark`, which parses the flags
and calls these): `engine` times the engine's pipelines in one process, `across` one
pipeline with a process per stage, `against_command` the training command beside the
engine, and `serve` is the worker `across` starts."""

from __future__ import annotations

import json
import os
import platform
import sys

import jax
import numpy as np
import optax

import dgrad
from dgrad import models
from dgrad.measure import balance, benchmark_across, benchmark_command, timing
from dgrad.measure import benchmark as bench
from dgrad.measure.benchmark_across import GPT_FLAGS, chain_of, example_batch
from dgrad.measure.timeline import Timeline
from dgrad.options import ALWAYS_CHUNKED, MICROBATCHED, Options
from dgrad.schedule import check_virtual_stages
from dgrad.train import distributed
from dgrad.train.cli import OneLineParser


def _refusal(method: str, k: int, m: int, v: int) -> str | None:
    """Why `Options` or the V schedules' rules (`dgrad.schedule.check_virtual_stages`) refuse
    `method` with V = `v` chunks a group on K = `k` groups and M = `m`; None where they do not."""
    try:
        Options(method=method, microbatches=m, virtual_stages=v)
        check_virtual_stages(k * v, v, m, method)
    except ValueError as error:
        return str(error)
    return None


def chunked_rows(method: str, k: int, m: int, virtual_stages) -> list[int]:
    """The V of the chunked rows beside `method`'s row at K = `k`, M = `m`: those of
    `virtual_stages` the library takes (interleaved 1F1B: M a multiple of K; ZB-V and
    DualPipeV: V = 2, DualPipeV with M >= 2K).

    >>> chunked_rows("1f1b", 2, 4, [2, 3]), chunked_rows("1f1b", 4, 2, [2])
    ([2, 3], [])
    >>> chunked_rows("zb", 2, 3, [2, 3]), chunked_rows("gpipe", 2, 4, [2])
    ([2], [])
    >>> chunked_rows("dualpipev", 2, 4, [2, 3]), chunked_rows("dualpipev", 2, 3, [2])
    ([2], [])
    """
    if k < 2:
        return []
    return [v for v in virtual_stages if v > 1 and _refusal(method, k, m, v) is None]


def unchunked_rows(method: str, k: int, m: int, virtual_stages, blocks: int) -> list[str]:
    """Why the chunked rows `--virtual-stages` asks for beside `method`'s row at K = `k`,
    M = `m` are not timed, a line each, in the library's words (the model has `blocks`
    blocks to cut into chunks); nothing for a method that takes no chunks.

    >>> unchunked_rows("1f1b", 2, 3, [2], 11)
    ['# no 1f1b V=2 M=3 row at K=2: virtual_stages=2 runs the microbatches in rounds of K=2 ...]
    >>> for line in unchunked_rows("zb", 4, 4, [2, 3], 6):
    ...     print(line)
    # no zb V=2 M=4 row at K=4: 8 chunks, the model has 6 blocks
    # no zb V=3 M=4 row at K=4: method=zb with virtual_stages=3: zero-bubble's V schedule ...
    """
    if k < 2 or _refusal(method, k, 2 * k, 2) is not None:  # a method that takes no chunks
        return []
    why = []
    for v in virtual_stages:
        reason = _refusal(method, k, m, v)
        if reason is None and k * v > blocks:
            reason = f"{k * v} chunks, the model has {blocks} blocks"
        if reason is not None:
            why.append(f"# no {method} V={v} M={m} row at K={k}: {reason}")
    return why


def _bubble(case) -> str:
    """A pipeline's measured idle % per device, beside the ideal (the timetable with the
    papers' unit costs, `dgrad.measure.timing`)."""
    pipe = case.pipe
    if pipe is None or pipe.options.fused or pipe.num_stages == 1 or not case.device_busy:
        return "-"
    idle = " ".join(f"{100 * (1 - b):.0f}" for b in case.device_busy.values())
    return f"{idle} [{100 * max(timing.simulate(pipe.schedule).idle):.0f}]"


def _per_call(case) -> str:
    """The host's µs per dispatched call, and the calls and moves of a step."""
    if case.pipe is None or not getattr(case, "dispatched", None):
        return "-"
    calls, moves = case.dispatched
    engine = 1e3 * bench.median(case.host_ms) / (calls + moves)
    each, in_order = (1e6 * seconds for seconds in case.floor)
    return (
        f"{engine:.0f} / {each:.0f} = {engine / each:.2f}x / {in_order:.0f} = "
        f"{engine / in_order:.2f}x [{calls}+{moves}]"
    )


def _print_dispatch_states(cases) -> None:
    """Each pipeline's host µs per call in the engine's steps beside the same step's calls
    replayed in four states of the devices' queues (`dgrad.measure.benchmark.dispatch_by_queue`)."""
    pipelines = [c for c in cases if c.num_stages > 1 and getattr(c, "dispatched", None)]
    table = [(c, bench.dispatch_by_queue(c.pipe, c.state, c.batch)) for c in pipelines]
    states = list(table[0][1]) if table else []
    print()
    print("| configuration | K | D | engine | " + " | ".join(states) + " |  (host µs per call)")
    print("|" + "---|" * (4 + len(states)))
    for case, seconds in table:
        engine = 1e3 * bench.median(case.host_ms) / sum(case.dispatched)
        print(
            f"| {case.name} | {case.num_stages} | {case.data_parallel} | {engine:.0f} | "
            + " | ".join(f"{1e6 * s:.0f}" for s in seconds.values())
            + " |"
        )


def _predicted(case, batch_size: int) -> str:
    """The step ms and idle % `dgrad.measure.timing` predicts from the measured cost of each call
    (medians of the traced window), beside the measured step ms."""
    if case.pipe is None or not getattr(case, "call_costs", None):
        return "- | -"
    predicted = case.prediction
    measured = 1e3 * batch_size / float(sorted(case.rates)[len(case.rates) // 2])
    idle = " ".join(f"{100 * i:.0f}" for i in predicted.idle)
    return f"{1e3 * predicted.step_seconds:.1f} / {measured:.1f} | {idle}"


def _spec_of(args) -> dict:
    """What `dgrad.measure.benchmark_across` builds the model and its batch from."""
    shape = {name: getattr(args, name) for name in GPT_FLAGS}
    return {
        "model": args.model,
        "width": args.width,
        "image_size": args.image_size,
        "batch_size": args.batch_size,
        **(shape if args.model == "gpt" else {}),
    }


def _blocks_of(args):
    return chain_of(_spec_of(args))


def _gpt_rates(args, chain, samples_per_s) -> str:
    """Tokens/s, model TFLOP/s and (with --peak-tflops) MFU of a GPT row."""
    tokens = samples_per_s * args.context
    flops = 6 * sum(chain.costs) / args.context * tokens  # 2 per multiply-add, x3 with backward
    mfu = f" | {100 * flops / (1e12 * args.peak_tflops):.1f}" if args.peak_tflops else ""
    return f" | {tokens:.0f} | {flops / 1e12:.3g}{mfu}"


def serve(argv):
    """A worker of `--processes`: `--serve --spec=JSON [--pin=CORE] [--cpu_devices=N]
    [--coordinator=... --num_processes=... --process_id=...]`."""
    parser = OneLineParser(prog="python -m experiments.benchmark --serve")
    for name in ("--spec", "--coordinator"):
        parser.add_argument(name)
    for name in ("--pin", "--cpu_devices", "--num_processes", "--process_id"):
        parser.add_argument(name, type=int)
    args = parser.parse_args(argv)
    benchmark_across.pin_and_join(
        args.pin,
        lambda: distributed.initialize(
            args.coordinator, args.num_processes, args.process_id, cpu_devices=args.cpu_devices
        ),
    )
    benchmark_across.serve(json.loads(args.spec))


def across(args):
    """`--processes K`: each of `--methods` across K processes pinned a core each, beside
    the same pipeline in one process and fused BP pinned to one core, with the share of
    its ceiling each reaches: the split's (sum of stage costs over the slowest stage) times
    1 - the timetable's ideal bubble (`dgrad.measure.timing`, the papers' unit costs)."""
    k = args.processes
    chain = _blocks_of(args)
    costs = chain.costs
    if args.split == "profiled":
        costs = balance.profile_blocks(chain.modules, _batch(args)[0], repeats=5)
        print("# block forward+backward ms: " + " ".join(f"{1e3 * c:.1f}" for c in costs))
    cuts = _cuts_for(args, chain, costs, k)
    ceiling = balance.speedup_ceiling(costs, cuts)
    several = [m for m in args.methods if m in MICROBATCHED and len(args.microbatches) > 1]
    if several:
        print(
            f"error: --processes times one configuration a method; give {several[0]} one "
            f"--microbatches value, not {','.join(map(str, args.microbatches))}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    specs, ceilings = [], {}
    for method in args.methods:
        options = {"microbatches": args.microbatches[0]} if method in MICROBATCHED else {}
        specs.append(
            {
                **_spec_of(args),
                "method": method,
                "fused": False,
                "stages": k,
                "cuts": list(cuts),
                "options": options,
            }
        )
        schedule = dgrad.Schedule(method, k, microbatches=options.get("microbatches", 1))
        bubble = float(np.mean(timing.simulate(schedule).idle))
        ceilings[benchmark_across.label(specs[-1])] = ceiling * (1 - bubble)
    print(f"# {args.model}, batch {args.batch_size}: K={k}, cuts {list(cuts)}")
    print(f"# predicted ceiling (sum of stage costs / slowest stage): {ceiling:.2f}x")
    rates = benchmark_across.compare_across_processes(
        specs, k, windows=args.windows, steps=args.steps
    )
    moves = {name: rates.pop(name) for name in list(rates) if name.endswith("moves ms/step")}
    base = np.array(rates["bp fused, pinned"])
    print()
    print(
        "| configuration | samples/s median [min-max] | x fused BP pinned [min-max] | "
        "ceiling x [1 - ideal bubble] | of the ceiling |"
    )
    print("|---|---|---|---|---|")
    for name, values in rates.items():
        values = np.array(values)
        ratio = values / base
        top = next((c for label, c in ceilings.items() if name.startswith(f"{label} K=")), None)
        share = "-" if top is None else f"{100 * np.median(ratio) / top:.0f}%"
        print(
            f"| {name} | {np.median(values):.1f} [{values.min():.1f}-{values.max():.1f}] | "
            f"{bench.summary(ratio)} | {'-' if top is None else f'{top:.2f}'} | {share} |"
        )
    for name, values in moves.items():
        label = name.removesuffix(" moves ms/step")
        pinned = np.median(rates[f"{label} K={k}, {k} processes pinned"])
        print(
            f"# moves between the processes, {label}: {np.median(values):.2f} ms/step "
            f"[{min(values):.2f}-{max(values):.2f}] of a {1e3 * args.batch_size / pinned:.0f} "
            "ms step"
        )
    return rates


def against_command(args):
    """`--against-command`: the training command's steady epochs beside the engine's
    windows, paired by rounds (`dgrad.measure.benchmark_command`)."""
    (k,) = args.stages
    chain = _blocks_of(args)
    cuts = _cuts_for(args, chain, chain.costs, k)
    spec = {**_spec_of(args), "stages": k, "cuts": list(cuts), "split": args.split}
    cases = [
        benchmark_command.Method(method, m)
        for method in args.methods
        for m in (args.microbatches if method in MICROBATCHED else [1])
    ]
    print(
        f"# {args.model}, batch {args.batch_size}, K={k}, cuts {list(cuts)}: {args.windows} "
        f"rounds; an engine window of {args.steps} steps, the command for "
        f"{args.command_epochs} epochs of {args.steps} steps, the two windows again (the "
        "engine's, fused BP pinned to a core)"
    )
    measured = benchmark_command.compare_with_command(
        spec, cases, rounds=args.windows, epochs=args.command_epochs, steps=args.steps
    )
    print()
    print(
        "| case | layout | engine samples/s median [min-max] | command samples/s median "
        "[min-max] | command / engine per round | command x fused BP pinned per round | "
        "eval s per epoch | checkpoint s per epoch |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (case, layout), found in measured.items():
        engine, command = np.array(found.engine), np.array(found.command)
        print(
            f"| {case} | {layout} | {np.median(engine):.1f} [{engine.min():.1f}-"
            f"{engine.max():.1f}] | {np.median(command):.1f} [{command.min():.1f}-"
            f"{command.max():.1f}] | {bench.summary(np.array(found.ratios))} | "
            f"{bench.summary(np.array(found.over_fused))} | "
            f"{np.median(found.eval_seconds):.2f} | {np.median(found.checkpoint_seconds):.2f} |"
        )
    return measured


def _cuts_for(args, chain, costs, k: int) -> list[int]:
    """Where `--split` cuts the model's blocks (`costs` each) into `k` stages; a split
    the model does not have is one line and exit 2."""
    split = balance.balanced_cuts(costs, k) if args.split == "profiled" else args.split
    try:
        return models.choose_cuts(split, k, costs, chain.authors, model=args.model)
    except ValueError as error:
        print(f"error: --split {args.split}: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def _batch(args):
    return example_batch(_spec_of(args))


def engine(args):
    """The engine's table: plain JAX, fused BP and every pipeline `args` asks for, timed in
    rounds in one process on fake CPU devices (or the GPUs), each traced once more for its
    devices' busy shares, the timing model's prediction and the host's floors."""
    steady = args.allocator == "steady" and bench.steady_allocator()  # before JAX allocates

    cpu_cores = os.cpu_count() or 1
    wanted_stages = max(args.stages) if args.stages else min(4, max(2, cpu_cores))
    jax.config.update("jax_num_cpu_devices", wanted_stages * max(args.data_parallel))

    devices = jax.devices()
    ks = args.stages or list(range(1, min(4, len(devices)) + 1))
    if max(ks) > len(devices):
        print(f"# {max(ks)} stages on {len(devices)} device(s): stages share devices")
    batch = _batch(args)

    if args.model == "gpt":
        print(
            f"# dgrad benchmark: GPT of {args.layers} blocks, d={args.dim}, {args.heads} heads, "
            f"batch {args.batch_size} x {args.context} bytes"
        )
    else:
        print(
            f"# dgrad benchmark: {args.model}, batch {args.batch_size}, {args.image_size}px images"
        )
    print(
        f"# {platform.node()} | {platform.processor() or platform.machine()} | {cpu_cores} "
        f"cores | {len(devices)} x {devices[0].device_kind} | jax {jax.__version__}"
    )
    if devices[0].platform == "cpu":
        print(f"# no accelerator: {len(devices)} fake CPU devices sharing {cpu_cores} cores")
    print(f"# malloc: {'fixed thresholds' if steady else 'as the C library sets it'}")

    chain = _blocks_of(args)
    if max(ks) > len(chain.modules):
        print(
            f"error: --stages {max(ks)}: {args.model} has {len(chain.modules)} blocks, so at "
            f"most {len(chain.modules)} stages",
            file=sys.stderr,
        )
        raise SystemExit(2)
    costs = chain.costs
    if args.split == "profiled":
        costs = balance.profile_blocks(chain.modules, batch[0], repeats=5)
        print("# block forward+backward ms: " + " ".join(f"{1e3 * c:.1f}" for c in costs))
    split = {
        k: _cuts_for(args, chain, costs, k)
        for k in sorted({1, *ks, *(k * v for k in ks for v in args.virtual_stages)})
        if k <= len(chain.modules)  # K = 1: the plain JAX floor and fused BP; K*V chunks
    }
    print(
        "# predicted ceiling (sum of stage costs / slowest stage): "
        + ", ".join(f"K={k}: {balance.speedup_ceiling(costs, split[k]):.2f}x" for k in ks if k > 1)
    )

    def stages(k):  # fresh modules for every configuration
        return _blocks_of(args).stages(k, split[k])

    optimizer = optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(0.01, momentum=0.9))
    cases = [bench.plain_case("plain JAX (no dgrad)", stages(1), optimizer, batch)]

    def add(name, k, chunks=None, **options):
        replicas = options.get("data_parallel", 1)
        groups = 1 if options.get("fused") else k
        if replicas > 1 and groups * replicas > len(devices):
            return
        model = stages(chunks or k)
        if options.get("method") == "dgl":
            model = models.with_aux_heads(model, 10, batch[0][:1])
        pipe = dgrad.Pipeline(model, optimizer=optimizer, devices=devices, **options)
        cases.append(bench.pipeline_case(name, pipe, batch))

    add("bp fused", 1, method="bp", fused=True)
    for d in args.data_parallel:
        if d > 1:
            add("bp fused, data parallel", 1, method="bp", fused=True, data_parallel=d)
    for d in args.data_parallel:
        for k in ks:
            if k > 1:
                add("bp staged", k, method="bp", data_parallel=d)
            for method in args.methods:
                if method in MICROBATCHED:
                    for m in args.microbatches:
                        if method not in ALWAYS_CHUNKED:
                            name = f"{method} M={m}"
                            add(name, k, method=method, microbatches=m, data_parallel=d)
                        if d == args.data_parallel[0]:
                            blocks = len(chain.modules)
                            for line in unchunked_rows(method, k, m, args.virtual_stages, blocks):
                                print(line)
                        for v in chunked_rows(method, k, m, args.virtual_stages):
                            if k * v <= len(chain.modules):
                                add(
                                    f"{method} V={v} M={m}",
                                    k,
                                    chunks=k * v,
                                    method=method,
                                    microbatches=m,
                                    virtual_stages=v,
                                    data_parallel=d,
                                )
                else:
                    add(method, k, method=method, data_parallel=d)
    if args.policies:
        top = max(ks)
        for name, options in [
            ("fdg dots", dict(memory="dots")),
            ("fdg recompute", dict(memory="recompute")),
            ("fdg current+recompute", dict(weights="current", memory="recompute")),
        ]:
            add(name, top, method="fdg", **options)
    bench.measure(cases, batch, windows=args.windows, steps=args.steps)

    for case in cases:  # one more window per pipeline, traced: when each device was busy
        case.device_busy = {}
        if case.pipe is None:
            continue
        for steps in (2, args.steps):  # a warm-up (compiles the watched copies), then real
            timeline = Timeline()
            watched = timeline.watch(case.pipe)
            for _ in range(steps):
                case.state, _ = watched.step(case.state, case.batch)
            timeline.close()
        case.device_busy = timeline.busy_fraction()
        case.call_costs = timing.costs_of(timeline.events)
        case.dispatched = bench.dispatched_per_step(case.pipe)
        dispatch = bench.median(case.host_ms) / 1e3 / sum(case.dispatched)
        case.floor = bench.dispatch_floor(case.pipe, case.state, case.batch)
        case.prediction = timing.simulate(case.pipe.schedule, case.call_costs, dispatch=dispatch)
        if args.timeline:
            os.makedirs(args.timeline, exist_ok=True)
            stem = os.path.join(
                args.timeline,
                f"{case.name.replace(' ', '-').replace(',', '')}-K{case.num_stages}"
                f"-D{case.data_parallel}",
            )
            timeline.gantt(stem + ".png", title=f"{args.model} {case.name} K={case.num_stages}")
            timeline.chrome_trace(stem + ".json")
    if args.timeline:
        print(f"# timelines written to {args.timeline}/")

    baseline = next(c for c in cases if c.name == "bp fused")
    columns = (
        "| configuration | K | D | samples/s median [min-max] | x fused BP [min-max] | "
        "host CPU ms/step | host µs per call / floor alone / floor in order [calls+moves] | "
        "cores busy | device busy % | "
        "idle % [ideal bubble] | predicted / measured step ms | predicted idle % | "
        "state MiB per device | records MiB at peak |"
    )
    if args.model == "gpt":
        columns += " tokens/s | model TFLOP/s |" + (" MFU % |" if args.peak_tflops else "")
    print()
    print(columns)
    print("|" + "|".join("---" for _ in columns.split("|")[1:-1]) + "|")
    for case in cases:
        rates = np.array(case.rates)
        memory = bench.state_bytes_per_device(case.state)
        records = bench.records_bytes_at_peak(case.pipe) if case.pipe is not None else {}
        print(
            f"| {case.name} | {case.num_stages} | {case.data_parallel} | "
            f"{np.median(rates):.1f} [{rates.min():.1f}-{rates.max():.1f}] | "
            f"{bench.summary(bench.ratios(case, baseline))} | "
            f"{bench.median(case.host_ms):.2f} | {_per_call(case)} | "
            f"{bench.median(case.cores_busy):.2f} | "
            + (" ".join(f"{100 * b:.0f}" for b in case.device_busy.values()) or "-")
            + f" | {_bubble(case)} | {_predicted(case, args.batch_size)} | "
            + " ".join(f"{b / 2**20:.1f}" for b in memory.values())
            + " | "
            + (" ".join(f"{b / 2**20:.1f}" for b in records.values()) or "-")
            + (_gpt_rates(args, chain, np.median(rates)) if args.model == "gpt" else "")
            + " |"
        )
    if args.dispatch_states:
        _print_dispatch_states(cases)
    peaks = bench.peak_memory(devices)
    if peaks:
        print(
            "# peak device memory MiB: "
            + ", ".join(f"{d}: {p / 2**20:.0f}" for d, p in peaks.items())
        )
    return cases
