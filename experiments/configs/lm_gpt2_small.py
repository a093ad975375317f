"""GPT-2 small's shape (12 blocks, d = 768, 12 heads, context 1024) as 4 stages of FDG,
with AdamW, warm-up then cosine, and each stage's gradient clipped at norm 1; fused BP
beside it. For GPU hosts with 4 devices.

GPT-2's vocabulary size: a byte-level BPE of 50,257 tokens trained on the training split (once,
then kept beside the data). 163M parameters: GPT-2 small's 124M plus the untied output head's
38.6M (tied, the embedding and the head would sit on two devices with gradients of different
staleness). `--config.tokenizer=bytes` gives 86M. Reads tfds's `lm1b` (prepare it once, like
CIFAR: the error says how; `--config.dataset=NAME:FEATURE` takes any other tfds text).
`:smoke` is a CPU-sized run of the same pipeline and data.

    python -m experiments.train --config experiments/configs/lm_gpt2_small.py --workdir runs/gpt2s
    python -m experiments.train --config experiments/configs/lm_gpt2_small.py \\
        --config.method=1f1b --config.microbatches=8 --workdir runs/gpt2s_1f1b
"""

from dgrad.train import config as fields
from dgrad.train.config import recipes


def get_config(variant: str = ""):
    config = fields.base()
    config.dataset = "lm1b"
    config.context = 1024
    config.tokenizer = "bpe"
    config.vocab_size = 50257
    config.model.name = "gpt"
    config.model.depth = 12
    config.model.width = 768
    config.model.heads = 12
    config.split = "balanced"
    config.method = "fdg"
    config.num_stages = 4
    config.baseline = "bp"
    config.batch_size = 32
    config.num_epochs = 50
    config.steps_per_epoch = 1000
    config.eval_examples = 1024
    config.eval_batch_size = 16
    config.optimizer.name = "adamw"
    config.optimizer.learning_rate = 6e-4
    config.optimizer.weight_decay = 0.1
    config.optimizer.schedule = "cosine"
    config.optimizer.warmup_epochs = 2
    config.optimizer.clip_norm = 1.0
    config.log_every_steps = 50
    return recipes.with_variant(config, variant)
