"""AsyncPP's language-model setting (Ajanthan et al., ICML 2025): a GPT of 8 blocks,
d = 768, 12 heads, context 512, as 8 stages of an asynchronous PipeDream-style pipeline
(`pipedream`: stage k applies the gradient of the batch from K-1-k steps ago, taken at the
weights that batch's forward used) with the authors' delay-dependent Nesterov momentum on
NAdamW (`async_nesterov`); fused BP with the same optimizer beside it. For GPU hosts with
8 devices.

Differences from the paper, chosen here: the paper trains on WikiText-103, which tfds
does not carry, so this reads tfds's `lm1b` (prepare it once, like CIFAR: the error says
how; `--config.dataset=NAME:FEATURE` takes any other tfds text); byte-level tokens; the
learning rate, warm-up, batch and length are ours, not the paper's. `:smoke` is a
CPU-sized run of the same pipeline and data.

    python -m experiments.train --config experiments/configs/lm_asyncpp.py --workdir runs/asyncpp
    python -m experiments.train --config experiments/configs/lm_asyncpp.py \\
        --config.optimizer.name=adamw --workdir runs/asyncpp_adamw   # the plain optimizer
"""

from dgrad.train import config as fields
from dgrad.train.config import recipes


def get_config(variant: str = ""):
    config = fields.base()
    config.dataset = "lm1b"
    config.context = 512
    config.model.name = "gpt"
    config.model.depth = 8
    config.model.width = 768
    config.model.heads = 12
    config.split = "balanced"
    config.method = "pipedream"
    config.num_stages = 8
    config.baseline = "bp"
    config.batch_size = 32
    config.num_epochs = 50
    config.steps_per_epoch = 1000
    config.eval_examples = 2048
    config.eval_batch_size = 32
    config.optimizer.name = "async_nesterov"
    config.optimizer.learning_rate = 3e-4
    config.optimizer.weight_decay = 0.01
    config.optimizer.schedule = "cosine"
    config.optimizer.warmup_epochs = 1
    config.optimizer.clip_norm = 1.0
    config.log_every_steps = 50
    return recipes.with_variant(config, variant)
