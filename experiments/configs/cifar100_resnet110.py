"""CIFAR-100, ResNet-110: FDG paper's CIFAR-100 setting, K = 2.

The authors' recipe: SGD 0.1, momentum 0.9, weight decay 5e-4, batch 128, 300 epochs,
lr / 10 at epochs 150 and 225 (FDG also 275). Needs CIFAR prepared (see docs/experiments.md);
`:smoke` is a CPU-sized run of the same data (add --config.dataset=synthetic to try it
without CIFAR).

    python -m experiments.train --workdir runs/cifar100_resnet110 \
        --config experiments/configs/cifar100_resnet110.py
    python -m experiments.train --workdir runs/cifar100_resnet110_ddg \
        --config experiments/configs/cifar100_resnet110.py --config.method=ddg
"""

from dgrad.train.config import recipes


def get_config(variant: str = ""):
    return recipes.paper("cifar100", "cifar_resnet", 110, num_stages=2, variant=variant)
