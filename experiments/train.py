"""Train a stage-split model with BP, DDG or FDG from an ml_collections config.

    python -m experiments.train                                      # the default config
    python -m experiments.train --config experiments/configs/cifar10_resnet56.py \\
        --config.method=ddg --workdir runs/r56_ddg
    python -m experiments.train --config experiments/configs/cifar10_resnet56.py:smoke

The default config trains a small ResNet on scikit-learn's digits (offline) with
FDG on two stages and with fused backprop, and prints both test accuracies.
`--workdir` of an existing run resumes it from its newest checkpoint. Without an
accelerator the stages run on fake CPU devices, one per stage.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    os.path.join(CONFIGS, "default.py"),
    "Experiment config file (append :smoke for the CPU-sized variant); override fields with "
    "--config.<field>=<value>.",
)
_WORKDIR = flags.DEFINE_string(
    "workdir",
    None,
    "Where metrics, checkpoints, plots and the exported model go; an existing run there is "
    "resumed. Default: runs/<config>-<date>-<time>.",
)


def _config_name() -> str:
    path = flags.FLAGS["config"].config_filename
    return os.path.splitext(os.path.basename(path.split(":")[0]))[0]


def main(argv) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    config = _CONFIG.value
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
    import jax

    # Only the CPU backend reads this: on a machine without accelerators each
    # stage gets its own (fake) CPU device, and the CPU cores work in parallel.
    jax.config.update("jax_num_cpu_devices", max(config.num_stages, 1))
    from dgrad import data, experiment

    workdir = _WORKDIR.value or experiment.default_workdir(_config_name())
    devices = jax.devices()
    if devices[0].platform == "cpu":
        print(
            f"No accelerator found: running {config.num_stages} stage(s) on {len(devices)} fake "
            "CPU devices.",
            flush=True,
        )
    elif len(devices) < config.num_stages:
        print(
            f"{config.num_stages} stages on {len(devices)} {devices[0].platform} devices: "
            "some devices hold several stages.",
            flush=True,
        )
    print(f"Workdir: {os.path.abspath(workdir)}", flush=True)
    try:
        results = experiment.train(config, workdir, devices=devices)
    except (ValueError, data.DatasetNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    except experiment.Stopped as stopped:
        print(
            f"\nStopped at step {stopped.step} after saving a checkpoint; run the same command "
            f"with --workdir {os.path.abspath(workdir)} to resume.",
            flush=True,
        )
        return 128 + stopped.signal_number
    print("\nTest accuracy:")
    for title, record in results.items():
        print(f"  {title:24s} {record['test_accuracy']:.4f}")
    print(f"\nCurves: {os.path.join(os.path.abspath(workdir), 'curves.png')}")
    return 0


if __name__ == "__main__":
    app.run(main)
