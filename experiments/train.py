"""Train a stage-split model with any of dgrad's methods from an experiment config.

    python -m experiments.train                                      # the default config
    python -m experiments.train --config experiments/configs/cifar10_resnet56.py \\
        --config.method=ddg --workdir runs/r56_ddg
    python -m experiments.train --help                               # flags and config fields

The default config trains a small ResNet on scikit-learn's digits (offline) with
FDG on two stages and with fused backprop, and prints both test accuracies.
See `dgrad.train.cli` for what the command does with a workdir, a signal or a
mistake.
"""

import os
import sys

from dgrad.train.signals import StopRequests  # first: a signal during start-up stops cleanly

if __name__ == "__main__":
    with StopRequests() as stop:
        from dgrad.train.supervisor import stop_with_parent

        stop_with_parent()  # started by a launcher or a sweep: stop when it dies
        from dgrad.train.cli import main

        configs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
        sys.exit(main(default_config=os.path.join(configs, "default.py"), stop=stop))
