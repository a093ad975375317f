"""The default experiment: a small ResNet on the offline digits, FDG on 2 stages beside fused BP.

python -m experiments.train                                # this config
python -m experiments.train --config experiments/configs/default.py:smoke
"""

from dgrad.train import config as fields
from dgrad.train.config import recipes


def get_config(variant: str = ""):
    config = fields.base()
    config.dataset = "digits"
    config.model.depth = 8
    config.model.width = 8
    config.split = "balanced"
    config.method = "fdg"
    config.num_stages = 2
    config.baseline = "bp"
    config.batch_size = 64
    config.num_epochs = 12
    config.eval_batch_size = 359
    config.optimizer.learning_rate = 0.05
    config.optimizer.schedule = "cosine"
    config.log_every_steps = 10
    if variant == "smoke":
        config.num_epochs = 3
        return config
    return recipes.with_variant(config, variant)
