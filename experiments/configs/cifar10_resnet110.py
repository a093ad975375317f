"""CIFAR-10, ResNet-110: FDG and DDG papers, K = 2 (also split for K = 4).

Plain FDG (beta = 1), as in the paper's main table; its best beta here was 0.5
(--config.beta=0.5).

The authors' recipe: SGD 0.1, momentum 0.9, weight decay 5e-4, batch 128, 300 epochs,
lr / 10 at epochs 150 and 225 (FDG also 275). Needs CIFAR prepared (see docs/experiments.md);
`:smoke` is a CPU-sized run of the same data (add --config.dataset=synthetic to try it
without CIFAR).

    python -m experiments.train --workdir runs/cifar10_resnet110 \
        --config experiments/configs/cifar10_resnet110.py
    python -m experiments.train --workdir runs/cifar10_resnet110_ddg \
        --config experiments/configs/cifar10_resnet110.py --config.method=ddg
"""

from dgrad.train.config import recipes


def get_config(variant: str = ""):
    return recipes.paper("cifar10", "cifar_resnet", 110, num_stages=2, variant=variant)
