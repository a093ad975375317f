"""Side-by-side training throughput: plain JAX, fused BP, staged BP, DDG, FDG and the
synchronous pipelines (GPipe, 1F1B, interleaved 1F1B, zero-bubble) and PipeDream-2BW,
with K stages x D replicas.

Every configuration is built and warmed up (compiled, pipeline filled) first; then
the timed windows go round-robin over the configurations, so each round compares
them under the same machine load (`dgrad.measure.benchmark`). The table gives medians and
[min-max] over rounds; ratios are per round against fused BP on one device.

    python -m experiments.benchmark --quick                  # a minute: ResNet-8, K = 1, 2
    python -m experiments.benchmark                          # ResNet-20, batch 64
    python -m experiments.benchmark --model resnet56 --batch-size 128 --stages 1,2,4
    python -m experiments.benchmark --stages 1,2 --data-parallel 1,2   # K x D layouts
    python -m experiments.benchmark --policies               # FDG's memory policies too
    python -m experiments.benchmark --allocator default      # glibc's own malloc thresholds
    python -m experiments.benchmark --processes 2            # DDG, FDG K=2, a process per stage
    python -m experiments.benchmark --model mlp --stages 2,4 --methods gpipe,1f1b,zb,ddg,fdg,2bw
    python -m experiments.benchmark --model gpt --stages 1,2 --batch-size 32   # tokens/s
    python -m experiments.benchmark --against-command --stages 2 --methods fdg,1f1b \\
        --microbatches 4 --steps 40 --windows 3   # the training command beside the engine

GPipe, 1F1B, ZB and 2BW run with each of `--microbatches` (default 4, 8), 1F1B
also interleaved with each of `--virtual-stages` (default 2; K*V chunks, where M is a
multiple of K) and ZB also as ZB-V where V = 2 is among them (2K chunks in a V);
DualPipeV (`dualpipev`) runs only as its V (V = 2, M >= 2K);
every pipelined row gives each device's measured idle share beside the
ideal bubble (the timetable played with the papers' unit costs, `dgrad.measure.timing`), the
step time and idle share `dgrad.measure.timing` predicts from the measured cost of each call,
the host's microseconds per dispatched call (stage calls and moves), and the records a
stage holds at the busiest moment of a step (GPipe: M microbatches, 1F1B: at most K).

Without an accelerator the stages run on fake CPU devices (one per stage and
replica), which share the machine's cores; on GPUs it uses the real devices.
With `--processes K` it times each of `--methods` (a microbatched one with one
`--microbatches` value) with K stages on K processes pinned to a core each, beside
the same pipeline in one process and fused BP pinned to one core, each with its
ceiling (the split's, times 1 - its timetable's ideal bubble) and the share of it
reached, and what the moves between the processes cost per step
(`dgrad.measure.benchmark_across`).

With `--against-command` it times the training command itself (`python -m
experiments.train` on synthetic images, the same cuts, batch and methods) beside
the bare engine, in one process on K fake devices and on K processes pinned to a
core each, in paired rounds: an engine window, the command for `--command-epochs`
epochs of `--steps` steps (its epochs after the first are timed, evaluation and
checkpoints apart), another engine window (`dgrad.measure.benchmark_command`).

`--model gpt` times a byte-level GPT (`--layers`, `--heads`, `--dim`, `--context`) on
random token windows; its rows give tokens/s and the model's training FLOP/s (6 x the
forward's multiply-adds per token, `dgrad.models.gpt_blocks`), and with `--peak-tflops`
(the device's peak for the dtype it runs) the model FLOPs utilisation.
"""

from __future__ import annotations

import sys

from dgrad.measure.benchmark_across import GPT_FLAGS, GPT_SHAPE
from dgrad.options import ALWAYS_CHUNKED, MICROBATCHED
from dgrad.train.cli import OneLineParser

METHODS = ("ddg", "fdg", "fr", "dgl", "gpipe", "1f1b", "zb", "dualpipev", "pipedream", "2bw")
MODELS = ("mlp", "resnet8", "resnet20", "resnet56", "resnet110", "wrn16-4", "wrn28-10", "gpt")


def parse_args(argv=None):
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="resnet20")
    parser.add_argument("--width", type=int, default=16, help="ResNet channels of group 1")
    parser.add_argument("--image-size", type=int, default=32)
    for name in GPT_FLAGS:
        parser.add_argument(f"--{name}", type=int, default=GPT_SHAPE[name], help=f"GPT {name}")
    parser.add_argument(
        "--peak-tflops", type=float, help="the device's peak TFLOP/s: adds the GPT's MFU"
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--stages", default=None, help="K values, e.g. 1,2,4 (default 1..4)")
    parser.add_argument("--data-parallel", default="1", help="D values, e.g. 1,2 (default 1)")
    parser.add_argument(
        "--split",
        choices=["profiled", "balanced", "authors", "auto"],
        default=None,
        help="profiled: balance measured block times (default; balanced with "
        "--against-command, which cuts as the training command does); balanced: multiply-adds",
    )
    parser.add_argument("--windows", type=int, default=9, help="timed rounds (default 9)")
    parser.add_argument("--steps", type=int, default=6, help="steps per timed window")
    parser.add_argument(
        "--policies", action="store_true", help="also FDG's other memory and weight policies"
    )
    parser.add_argument(
        "--methods", default="ddg,fdg", help=f"pipelined methods to time: {', '.join(METHODS)}"
    )
    parser.add_argument(
        "--microbatches", default="4,8", help="M values for gpipe, 1f1b, zb and 2bw (default 4,8)"
    )
    parser.add_argument(
        "--virtual-stages",
        default=None,
        help="V values for interleaved 1f1b rows, and 2 for ZB-V rows of zb (default 2)",
    )
    parser.add_argument(
        "--timeline", metavar="DIR", help="write a Gantt chart and Perfetto trace of each case"
    )
    parser.add_argument(
        "--allocator",
        choices=["steady", "default"],
        default="steady",
        help="steady: fix glibc malloc's thresholds so no case is favoured (default); "
        "default: glibc's moving thresholds (dgrad.measure.benchmark.steady_allocator)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        help="time the pipeline with a process per stage (pinned to a core each), K = this",
    )
    parser.add_argument(
        "--against-command",
        action="store_true",
        help="time the training command (python -m experiments.train) beside the engine, in "
        "one process and on K pinned processes; --steps is an epoch, --windows the rounds",
    )
    parser.add_argument(
        "--command-epochs",
        type=int,
        default=3,
        help="epochs of each training command run, the first not timed (default 3)",
    )
    parser.add_argument(
        "--dispatch-states",
        action="store_true",
        help="also the host's µs per call of each pipeline's step in four states of the "
        "devices' queues (dgrad.measure.benchmark.dispatch_by_queue)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a one-minute check: ResNet-8 (width 8), batch 32, K = 1, 2, 3 rounds of 3 steps, "
        "balanced split (flags given beside it change those)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        quick = dict(model="resnet8", width=8, batch_size=32, stages="1,2", windows=3, steps=3)
        parser.set_defaults(**quick, split="balanced")
        args = parser.parse_args(argv)

    def numbers(text, name):
        try:
            values = sorted({int(v) for v in text.split(",")})
        except ValueError:
            parser.error(f"--{name} takes integers separated by commas, got {text!r}")
        if min(values) < 1:
            parser.error(f"--{name} values must be positive")
        return values

    args.stages = numbers(args.stages, "stages") if args.stages else None
    args.data_parallel = numbers(args.data_parallel, "data-parallel")
    args.microbatches = numbers(args.microbatches, "microbatches")
    if args.virtual_stages is not None and (args.processes or args.against_command):
        which = "--processes" if args.processes else "--against-command"
        parser.error(f"{which} times V = 1 rows only; leave --virtual-stages out")
    args.virtual_stages = [
        v for v in numbers(args.virtual_stages or "2", "virtual-stages") if v > 1
    ]
    args.methods = [m for m in args.methods.split(",") if m]
    if not args.methods:
        parser.error(f"--methods is empty; name one or more of {', '.join(METHODS)}")
    chunked_only = [m for m in args.methods if m in ALWAYS_CHUNKED]
    if chunked_only and (args.processes or args.against_command):
        which = "--processes" if args.processes else "--against-command"
        parser.error(
            f"{which} times V = 1 rows only, and {chunked_only[0]} runs as a V of 2K chunks; "
            "time it without that flag"
        )
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {unknown[0]!r}; choose from {', '.join(METHODS)}")
    if args.model == "gpt" and "dgl" in args.methods:
        parser.error("--methods dgl: its auxiliary heads classify images; not on --model gpt")
    if args.model == "gpt" and args.dim % args.heads:
        parser.error(f"--dim {args.dim} must be a multiple of --heads {args.heads}")
    for name in ("width", "image_size", "batch_size", "windows", "steps", *GPT_FLAGS):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.against_command:
        from dgrad.measure.benchmark_command import refusal

        k = args.stages[0] if args.stages and len(args.stages) == 1 else 0  # one K, or none
        refused = refusal(args.model, args.image_size, k, args.command_epochs)
        if refused:
            parser.error(refused)
        if args.split == "profiled":
            parser.error(
                "--against-command cuts as the training command can: --split balanced, "
                "authors or auto"
            )
    args.split = args.split or ("balanced" if args.against_command else "profiled")
    if args.processes is not None and args.processes < 2:
        parser.error("--processes needs 2 or more (one stage per process)")
    parts = args.microbatches if set(args.methods) & set(MICROBATCHED) else [1]
    uneven = [(d, m) for d in args.data_parallel for m in parts if args.batch_size % (d * m)]
    if uneven:
        d, m = uneven[0]
        parser.error(
            f"--batch-size {args.batch_size} does not split between {d} replicas"
            + (f" x {m} microbatches" if m > 1 else "")
            + " (--data-parallel, --microbatches); use a multiple of each D x M"
        )
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    from dgrad.measure import report  # after the flags: a mistake is one line at once

    if argv[:1] == ["--serve"]:
        return report.serve(argv[1:]) or True
    args = parse_args(argv)
    if args.processes:
        return report.across(args)
    if args.against_command:
        return report.against_command(args)
    return report.engine(args)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
