"""Writes `checkpoint_with_variables/`: a checkpoint of dgrad 60ad569, which held weights
and statistics as `nnx.Variable`s (each array one level deeper, under `value`).

    git worktree add /tmp/dgrad-60ad569 60ad569 && cd /tmp/dgrad-60ad569
    python /path/to/tests/data/write_checkpoint_with_variables.py OUT_DIR

The ResNet-8 test CNN, FDG on 2 stages (beta 0.7, the smooth optimizer), saved after
5 steps of the tests' data stream; `test_checkpoint.py` resumes it.
"""

import sys

import jax

jax.config.update("jax_num_cpu_devices", 4)
sys.path.insert(0, "tests")
from helpers import SMOOTH_OPTIMIZER, batches, build_pipeline  # noqa: E402

from dgrad.train.checkpoint import Checkpointer  # noqa: E402

data = batches("cnn", 5)
pipe = build_pipeline(
    "cnn", 2, method="fdg", beta=0.7, optimizer=SMOOTH_OPTIMIZER, devices=jax.devices()[:2]
)
state = pipe.init(data[0])
for batch in data:
    state, _ = pipe.step(state, batch)
with Checkpointer(sys.argv[1]) as checkpoints:
    checkpoints.save(state, {"note": "mid-run"})
