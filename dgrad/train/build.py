"""From a config to what trains: the runs, the data, the model's stages, the optimizer
(with the papers' recipe) and the pipeline.

>>> from dgrad.train import config as fields
>>> config = fields.base()
>>> from dgrad.train.config.recipes import resolved_optimizer
>>> resolved_optimizer(config, "ddg")["nesterov"], resolved_optimizer(config, "fdg")["boundaries"]
(True, (150, 225, 275))
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from dgrad import data, models, optim
from dgrad.pipeline import Pipeline
from dgrad.train.config import Run
from dgrad.train.config.recipes import resolved_optimizer


def load_dataset(config: ml_collections.ConfigDict) -> data.Dataset:
    """The config's dataset (raises `data.DatasetNotFoundError` saying how to prepare it).

    >>> from dgrad.train import config as fields
    >>> config = fields.base()
    >>> config.dataset = "digits"
    >>> dataset = load_dataset(config)
    >>> dataset.name, len(dataset.train), dataset.input_shape
    ('digits', 1438, (8, 8, 1))
    """
    return data.load(
        config.dataset,
        data_dir=config.data_dir or None,
        seed=config.seed,
        image_size=config.image_size,
        context=config.context,
        tokenizer=config.tokenizer,
        vocab_size=config.vocab_size,
        synthetic_examples=config.synthetic_examples,
    )


def steps_per_epoch(
    config: ml_collections.ConfigDict, dataset: data.Dataset, *, cut: bool = False
) -> int:
    """Batches per epoch: the training split's full batches, or `config.steps_per_epoch` if
    fewer. More raises a ValueError, or with `cut` (a workdir started so by an earlier
    version, which cut it silently) is cut to the split's.

    >>> from dgrad.train import config as fields
    >>> config = fields.base()
    >>> config.dataset, config.batch_size = "digits", 100
    >>> steps_per_epoch(config, load_dataset(config))  # 1438 // 100
    14
    """
    full = data.Stream(  # (it checks the batch size)
        dataset.train, config.batch_size, transform=None, seed=0
    ).steps_per_epoch
    if config.steps_per_epoch > full and not cut:
        raise ValueError(
            f"config.steps_per_epoch={config.steps_per_epoch} is more than the {full} batches "
            f"of {config.batch_size} in {config.dataset}'s training split; use at most {full}, "
            "or -1 for the whole split"
        )
    return min(config.steps_per_epoch, full) if config.steps_per_epoch > 0 else full


def build_stages(config: ml_collections.ConfigDict, num_stages: int, dataset: data.Dataset):
    """The model of `config.model`, cut into `num_stages` stages by `config.split`.

    >>> from dgrad.train import config as fields
    >>> config = fields.base()
    >>> config.dataset, config.model.name, config.split = "digits", "mlp", "balanced"
    >>> stages = build_stages(config, 2, load_dataset(config))
    >>> [len(stage.layers) for stage in stages]  # the MLP 64 -> 128 -> 128 -> 10
    [1, 2]
    """
    spec, classes, channels = config.model, dataset.num_classes, dataset.input_shape[-1]
    if spec.name == "gpt":
        return models.gpt(
            classes,
            spec.depth,
            spec.heads,
            spec.width,
            config.context,
            num_stages,
            split="balanced" if config.split in ("auto", "authors") else config.split,
            rngs=config.seed,
        )
    if spec.name == "cifar_resnet":
        return models.cifar_resnet(
            spec.depth,
            classes,
            num_stages,
            width=spec.width,
            in_channels=channels,
            split=config.split,
            rngs=config.seed,
        )
    if spec.name == "wide_resnet":
        return models.wide_resnet(
            spec.depth,
            spec.widen,
            classes,
            num_stages,
            in_channels=channels,
            split=config.split,
            rngs=config.seed,
        )
    if spec.name == "cnn1d":
        return models.cnn1d(
            classes,
            num_stages,
            num_blocks=spec.depth,
            width=spec.width,
            in_channels=channels,
            split=config.split,
            rngs=config.seed,
        )
    features = [math.prod(dataset.input_shape), *spec.hidden, classes]
    return models.mlp(features, num_stages, split=config.split, rngs=config.seed)


def learning_rate(
    config: ml_collections.ConfigDict, method: str, steps_per_epoch: int, accumulate: int = 1
) -> optax.Schedule:
    """The learning rate of a stage's n-th update. With `accumulate` = M a stage updates
    once every M steps, so epochs are counted in steps / M (as the ADL code counts data
    steps); a warm-up of W updates rises on the line from lr / 100 (before the first
    update) to lr (at the W-th): update n gets lr * (0.01 + 0.99 * (n + 1) / W).

    >>> from dgrad.train import config as fields
    >>> config = fields.base()  # lr 0.1, divided by 10 at epochs 150, 225 and 275 (FDG)
    >>> rate = learning_rate(config, "fdg", steps_per_epoch=10)
    >>> [round(float(rate(n)), 6) for n in (0, 1499, 1500, 2250)]
    [0.1, 0.1, 0.01, 0.001]
    """
    spec = resolved_optimizer(config, method)
    updates_per_epoch = steps_per_epoch / accumulate
    rate, total = spec["learning_rate"], int(config.num_epochs * updates_per_epoch)
    if spec["schedule"] == "piecewise":
        main = optax.piecewise_constant_schedule(
            rate, {int(e * updates_per_epoch): spec["decay"] for e in spec["boundaries"]}
        )
    elif spec["schedule"] == "cosine":
        main = optax.cosine_decay_schedule(rate, total)
    else:
        main = optax.constant_schedule(rate)
    warmup = int(spec["warmup_epochs"] * updates_per_epoch)
    if not warmup:
        return main

    def warmed_up(count):
        ramp = rate * (0.01 + 0.99 * (count + 1) / warmup)
        return jnp.where(count < warmup, ramp, main(count))

    return warmed_up


def build_optimizer(
    config: ml_collections.ConfigDict,
    method: str,
    steps_per_epoch: int,
    accumulate: int = 1,
    num_stages: int | None = None,
):
    """The config's optimizer (SGD with momentum and coupled weight decay, AdamW, Muon, or
    the asynchronous-pipeline Nesterov, whose momentum per stage follows that stage's
    staleness among `num_stages`) on its schedule, each stage's gradient clipped by its own
    norm if `clip_norm` is set: an optax transformation, or a function of the stage index.
    Schedules count each stage's own updates (a stage that starts updating later in an
    FDG pipeline reaches each boundary a few steps later).

    >>> import jax.numpy as jnp
    >>> from dgrad.train import config as fields
    >>> tx = build_optimizer(fields.base(), "ddg", steps_per_epoch=10)  # Nesterov: lr (1 + 0.9)
    >>> tx.update(jnp.ones(2), tx.init(jnp.zeros(2)), jnp.zeros(2))[0]
    Array([-0.19, -0.19], dtype=float32)
    """
    spec = resolved_optimizer(config, method)
    rate = learning_rate(config, method, steps_per_epoch, accumulate)

    def clipped(tx):  # each stage has its own optimizer: clipped by its own norm
        if spec["clip_norm"] > 0:
            return optax.chain(optax.clip_by_global_norm(spec["clip_norm"]), tx)
        return tx

    if spec["name"] == "async_nesterov":  # a momentum per stage, from its staleness
        per_stage = optim.async_nesterov_for(
            rate, method, num_stages or config.num_stages, weight_decay=spec["weight_decay"]
        )
        return lambda k: clipped(per_stage(k))
    if spec["name"] == "adamw":
        tx = optax.adamw(rate, weight_decay=spec["weight_decay"])
    elif spec["name"] == "muon":
        tx = optax.contrib.muon(
            rate, weight_decay=spec["weight_decay"], adam_weight_decay=spec["weight_decay"]
        )
    else:
        tx = optax.chain(
            optax.add_decayed_weights(spec["weight_decay"]),
            optax.sgd(rate, spec["momentum"] or None, nesterov=spec["nesterov"]),
        )
    return clipped(tx)


def build_pipeline(
    config: ml_collections.ConfigDict,
    run: Run,
    dataset: data.Dataset,
    steps_per_epoch: int,
    devices,
) -> Pipeline:
    """The run's pipeline on `devices` (the fused baseline uses D of them, one from each
    process in turn).

    >>> import jax
    >>> from dgrad.train import config as fields
    >>> config = fields.base()
    >>> config.dataset, config.model.name, config.split = "digits", "mlp", "balanced"
    >>> run = fields.runs_of(config)[0]
    >>> build_pipeline(config, run, load_dataset(config), 10, jax.devices()[:1])
    Pipeline(method='fdg', num_stages=2, beta=1.0, weights='stash', memory='residuals', ...)
    """
    try:
        stages = build_stages(config, run.num_stages, dataset)
    except ValueError as error:
        if run.num_stages == config.num_stages:
            raise
        raise ValueError(
            f"{error} Here the {run.num_stages} are num_stages={config.num_stages} x "
            f"virtual_stages={config.virtual_stages} chunks."
        ) from None
    if run.method == "dgl":
        example = np.zeros((1, *dataset.input_shape), np.float32)
        stages = models.with_aux_heads(stages, dataset.num_classes, example, rngs=config.seed)
    baseline = run.fused
    accumulate = 1 if baseline else config.accumulate
    try:
        pipe = _pipeline(config, run, stages, steps_per_epoch, accumulate, devices)
    except ValueError as error:
        if not baseline:
            raise
        raise ValueError(
            f"{error} For the fused-BP baseline (config.baseline=bp: one device group, "
            f"data_parallel={config.data_parallel}), add --config.baseline= to leave it out."
        ) from None
    pipe.placement.check_batch_size(config.batch_size)
    return pipe


def _pipeline(config, run: Run, stages, steps_per_epoch: int, accumulate: int, devices):
    baseline = run.fused
    return Pipeline(
        stages,
        method=run.method,
        optimizer=build_optimizer(
            config, run.method, steps_per_epoch, accumulate, num_stages=run.num_stages
        ),
        beta=config.beta if run.method == "fdg" else 1.0,
        weights=None if baseline else config.weights,
        memory=None if baseline else config.memory,
        fused=run.fused,
        data_parallel=config.data_parallel,
        accumulate=accumulate,
        probe_every=None if baseline else config.probe_every,
        microbatches=None if baseline else config.microbatches,
        virtual_stages=1 if baseline else config.virtual_stages,
        predict=None if baseline else config.predict,
        predict_lr=None if baseline else config.predict_lr,
        record_sources=True,  # checkpoints hold what a VJP is computed from
        devices=devices,
        placement="spread" if run.fused else config.placement,
    )
