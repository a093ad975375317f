"""MNIST-1D (Greydanus 2020, generated offline): a 1-D ResNet of 8 equal blocks, cut into
K = 2, 4 or 8 stages, for studies of staleness at small scale on a CPU.

With plain backprop it reaches about 98% test accuracy in 20 epochs (about 15 s of
training on this project's 2-core CPU).

    python -m experiments.train --config experiments/configs/mnist1d.py --workdir runs/m1d
    python -m experiments.sweep --config experiments/configs/mnist1d.py --workdir runs/m1d_sweep \\
        --grid 'method=bp,ddg,fdg num_stages=2,4,8 beta=1,0.5 seed=0,1,2'
"""

from dgrad.train import config as fields
from dgrad.train.config import recipes


def get_config(variant: str = ""):
    config = fields.base()
    config.dataset = "mnist1d"
    config.model.name = "cnn1d"
    config.model.depth = 8  # residual blocks
    config.model.width = 16
    config.split = "balanced"
    config.method = "fdg"
    config.num_stages = 4
    config.batch_size = 64
    config.num_epochs = 20
    config.eval_batch_size = 500
    config.optimizer.learning_rate = 0.05
    config.optimizer.schedule = "cosine"
    config.log_every_steps = 20
    if variant == "smoke":
        config.num_epochs = 2
        return config
    return recipes.with_variant(config, variant)
