"""The digits (offline) with an 8-layer MLP, so that it can be cut into K = 2, 4 or 8 stages:
the quick partner of mnist1d.py in the offline sweeps.

    python -m experiments.sweep --config experiments/configs/digits_mlp.py \\
        --workdir runs/digits_sweep --grid 'method=bp,ddg,fdg num_stages=2,4,8 seed=0,1,2'
"""

from dgrad.train import config as fields
from dgrad.train.config import recipes


def get_config(variant: str = ""):
    config = fields.base()
    config.dataset = "digits"
    config.model.name = "mlp"
    config.model.hidden = (64,) * 7  # 8 linear layers
    config.split = "balanced"
    config.method = "fdg"
    config.num_stages = 4
    config.batch_size = 64
    config.num_epochs = 30
    config.eval_batch_size = 359
    config.optimizer.learning_rate = 0.05
    config.optimizer.schedule = "cosine"
    config.log_every_steps = 11
    if variant == "smoke":
        config.num_epochs = 3
        return config
    return recipes.with_variant(config, variant)
