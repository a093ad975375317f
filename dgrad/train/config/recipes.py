"""The papers' recipes: their CIFAR settings, the choices they leave to the method
(decay epochs, Nesterov, warm-up), and the CPU-sized `smoke` variant of a config.

The optimizer fields left unset in a config are filled at build time, per method, by
`resolved_optimizer`; a field the config sets stays as set.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from dgrad.train.config.fields import base


def paper(
    dataset: str,
    model: str,
    depth: int,
    *,
    num_stages: int = 2,
    beta: float = 1.0,
    widen: int = 10,
    variant: str = "",
) -> ml_collections.ConfigDict:
    """A setting of the FDG/DDG papers on CIFAR: FDG with the authors' split and recipe
    (SGD 0.1, momentum 0.9, weight decay 5e-4, batch 128, 300 epochs; the decay epochs
    and Nesterov follow the method, see `resolved_optimizer`).

    `variant="smoke"` keeps the method, K and data but shrinks the model and the run
    to a CPU-sized one, see `smoke`.

    >>> config = paper("cifar10", "cifar_resnet", 56, num_stages=4, beta=0.5)
    >>> config.num_stages, config.beta, config.split, config.batch_size, config.num_epochs
    (4, 0.5, 'authors', 128, 300)
    """
    config = base()
    config.dataset = dataset
    config.model.name = model
    config.model.depth = depth
    config.model.widen = widen
    config.num_stages = num_stages
    config.beta = beta
    return with_variant(config, variant)


def authors_boundaries(method: str) -> tuple[int, ...]:
    """Epochs where the papers divide the learning rate by 10 (FDG adds a third decay).

    >>> authors_boundaries("fdg"), authors_boundaries("ddg")
    ((150, 225, 275), (150, 225))
    """
    return (150, 225, 275) if method == "fdg" else (150, 225)


def resolved_optimizer(config: ml_collections.ConfigDict, method: str) -> dict[str, Any]:
    """`config.optimizer` with its unset fields filled by the authors' choice for `method`:
    decay epochs (`authors_boundaries`), Nesterov momentum (DDG's code used it), and the
    ADL code's 5-epoch warm-up when gradients accumulate.

    >>> spec = resolved_optimizer(base(), "ddg")
    >>> spec["boundaries"], spec["nesterov"], spec["warmup_epochs"], spec["learning_rate"]
    ((150, 225), True, 0, 0.1)
    """
    spec = config.optimizer.to_dict()
    if spec["boundaries"] is None:
        spec["boundaries"] = authors_boundaries(method)
    if spec["nesterov"] is None:
        spec["nesterov"] = method == "ddg"
    if spec["warmup_epochs"] is None:
        spec["warmup_epochs"] = 5 if config.accumulate > 1 else 0
    return spec


def with_variant(config: ml_collections.ConfigDict, variant: str) -> ml_collections.ConfigDict:
    """`config` itself, or its `smoke` variant; any other variant is refused.

    >>> with_variant(base(), "").num_epochs, with_variant(base(), "smoke").num_epochs
    (300, 2)
    """
    if variant == "smoke":
        return smoke(config)
    if variant:
        raise ValueError(f"unknown config variant {variant!r}; the only variant is smoke")
    return config


def smoke(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Shrinks `config` in place to a CPU-sized run of the same method and data: ResNet-20
    or WRN-16-2 with a balanced split (the authors' splits exist only at full depth), a GPT
    of d = 32 over windows of 32 tokens, 2 epochs of 8 batches of 32, 256 test examples.

    >>> config = smoke(base())
    >>> config.model.depth, config.split, config.num_epochs, config.steps_per_epoch
    (20, 'balanced', 2, 8)
    """
    if config.model.name == "cifar_resnet":
        config.model.depth = 20
    elif config.model.name == "wide_resnet":
        config.model.depth, config.model.widen = 16, 2
    elif config.model.name == "gpt":  # a block per stage (at least 2), d = 32, context 32
        config.model.depth = max(2, config.num_stages)
        config.model.width, config.model.heads, config.context = 32, 2, 32
    config.split = "balanced"
    config.batch_size = 32
    config.num_epochs = 2
    config.steps_per_epoch = 8
    config.eval_examples = 256
    config.eval_batch_size = 128
    config.log_every_steps = 4
    return config
