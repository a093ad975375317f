"""A small GPT on the offline corpus (this interpreter's standard library source, bytes):
FDG on 2 stages beside fused BP, AdamW with warm-up then cosine, each stage's gradient
clipped by its own norm.

python -m experiments.train --config experiments/configs/lm_stdlib.py
python -m experiments.train --config experiments/configs/lm_stdlib.py:smoke
"""

from dgrad.train import config as fields
from dgrad.train.config import recipes


def get_config(variant: str = ""):
    config = fields.base()
    config.dataset = "stdlib"
    config.context = 64
    config.model.name = "gpt"
    config.model.depth = 4  # blocks
    config.model.width = 128  # dim
    config.model.heads = 4
    config.split = "balanced"
    config.method = "fdg"
    config.num_stages = 2
    config.baseline = "bp"
    config.batch_size = 32
    config.num_epochs = 6
    config.steps_per_epoch = 100
    config.eval_examples = 512
    config.eval_batch_size = 128
    config.optimizer.name = "adamw"
    config.optimizer.learning_rate = 3e-3
    config.optimizer.weight_decay = 0.01
    config.optimizer.schedule = "cosine"
    config.optimizer.warmup_epochs = 1
    config.optimizer.clip_norm = 1.0
    config.log_every_steps = 20
    return recipes.with_variant(config, variant)
