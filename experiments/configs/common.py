"""The config fields every experiment shares, the papers' CIFAR recipe, and smoke sizes.

Fields (`experiments/configs/*.py` set them; `--config.<field>=...` overrides):

- dataset: digits | synthetic | cifar10 | cifar100 | imagenet2012; data_dir: where tfds
  datasets are prepared ('' = $TFDS_DATA_DIR or ~/tensorflow_datasets); image_size (ImageNet).
- model.name: cifar_resnet (model.depth, model.width) | wide_resnet (model.depth,
  model.widen) | mlp (model.hidden); split: authors | balanced | auto (see dgrad.models).
- method: bp | ddg | fdg; num_stages: K; beta: FDG gradient shrinking; weights: stash |
  current; memory: residuals | recompute; placement: spread | one_per_device.
- baseline: 'bp' also trains fused backprop on one device beside the run; '' does not.
- batch_size, num_epochs, steps_per_epoch (-1: the whole training split), eval_examples
  (-1: the whole test split), eval_batch_size, seed.
- optimizer: SGD with momentum and weight decay; schedule piecewise (lr * decay at each
  epoch in boundaries) | cosine | constant. Unset boundaries and nesterov take the
  authors' choice for the method: decay at epochs 150 and 225 (FDG also 275), Nesterov for DDG.
- log_every_steps, checkpoint_every_steps (0: only at epoch ends), keep_checkpoints,
  prefetch, data_workers: how the run is watched, stored and fed.
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict


def base() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.dataset = "cifar10"
    config.data_dir = ""
    config.image_size = 224

    config.model = ml_collections.ConfigDict()
    config.model.name = "cifar_resnet"
    config.model.depth = 56
    config.model.width = 16
    config.model.widen = 10
    config.model.hidden = (128, 128)
    config.split = "authors"

    config.method = "fdg"
    config.num_stages = 2
    config.beta = 1.0
    config.weights = "stash"
    config.memory = "residuals"
    config.placement = "spread"
    config.baseline = ""

    config.batch_size = 128
    config.num_epochs = 300
    config.steps_per_epoch = -1
    config.eval_examples = -1
    config.eval_batch_size = 500
    config.seed = 0

    config.optimizer = ml_collections.ConfigDict()
    config.optimizer.learning_rate = 0.1
    config.optimizer.momentum = 0.9
    config.optimizer.nesterov = config_dict.placeholder(bool)
    config.optimizer.weight_decay = 5e-4
    config.optimizer.schedule = "piecewise"
    config.optimizer.boundaries = config_dict.placeholder(tuple)
    config.optimizer.decay = 0.1

    config.log_every_steps = 50
    config.checkpoint_every_steps = 0
    config.keep_checkpoints = 2
    config.prefetch = 4
    config.data_workers = 4
    return config


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
    """A setting of the FDG/DDG papers on CIFAR: FDG with the authors' split and recipe.

    `variant="smoke"` keeps the method, K and data but shrinks the model (ResNet-20,
    WRN-16-2, balanced split: the authors' splits exist only at full depth) and the run
    (2 epochs of 8 batches of 32, 256 test images) so that it runs on a CPU in minutes.
    """
    config = base()
    config.dataset = dataset
    config.model.name = model
    config.model.depth = depth
    config.model.widen = widen
    config.num_stages = num_stages
    config.beta = beta
    if variant == "smoke":
        smoke(config)
    elif variant:
        raise ValueError(f"Unknown config variant {variant!r}; use 'smoke' or nothing.")
    return config


def smoke(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Shrinks `config` in place to a CPU-sized run of the same method and data."""
    if config.model.name == "cifar_resnet":
        config.model.depth = 20
    elif config.model.name == "wide_resnet":
        config.model.depth, config.model.widen = 16, 2
    config.split = "balanced"
    config.batch_size = 32
    config.num_epochs = 2
    config.steps_per_epoch = 8
    config.eval_examples = 256
    config.eval_batch_size = 128
    config.log_every_steps = 4
    return config
