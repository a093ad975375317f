"""The trained stages merged into one model on one device, for evaluation and inference,
saved with orbax and loaded again into freshly built stages.

>>> import jax.numpy as jnp, numpy as np, optax, tempfile, dgrad
>>> from dgrad import models
>>> pipe = dgrad.Pipeline(models.mlp([4, 8, 3], num_stages=2), method="ddg",
...                       optimizer=optax.sgd(0.1))
>>> batch = (jnp.ones((2, 4)), jnp.zeros((2,), jnp.int32))
>>> state, _ = pipe.step(pipe.init(batch), batch)
>>> model = merge(pipe, state)
>>> bool(np.allclose(model(batch[0]), pipe.predict(state, batch[0])))
True
>>> path = save(model, tempfile.mkdtemp() + "/model")
>>> again = load(models.mlp([4, 8, 3], num_stages=2, rngs=1), path)
>>> bool(jnp.array_equal(again(batch[0]), model(batch[0])))
True
"""

from __future__ import annotations

import os
from typing import Sequence

import jax
import orbax.checkpoint as ocp
from flax import nnx

from dgrad.models.aux import AuxStage
from dgrad.pipeline import Pipeline
from dgrad.placement import share
from dgrad.state import PipelineState


def merge(pipe: Pipeline, state: PipelineState, device: jax.Device | None = None) -> nnx.Sequential:
    """One `nnx.Sequential` of all stages with `state`'s current weights, in eval mode,
    auxiliary heads left out. Every array is copied to `device` (default the first stage's
    first device), so the model shares no buffer with the pipeline; under several processes
    the arrays are gathered onto one device of every process (`dgrad.placement.share`), and
    every process calls `save`.

    >>> import jax.numpy as jnp, optax, dgrad
    >>> from dgrad import models
    >>> pipe = dgrad.Pipeline(models.mlp([4, 8, 3], num_stages=2), method="ddg",
    ...                       optimizer=optax.sgd(0.1))
    >>> model = merge(pipe, pipe.init((jnp.ones((2, 4)), jnp.zeros((2,), jnp.int32))))
    >>> len(model.layers), model(jnp.ones((5, 4))).shape  # any batch size, on one device
    (2, (5, 3))
    """
    modules = []
    for fns, stage in zip(pipe.stages, state.stages):
        if jax.process_count() > 1:
            params, rest = share((stage.params, stage.rest))
        else:
            target = device or pipe.devices[0]
            params, rest = jax.device_put((stage.params, stage.rest), target, may_alias=False)
        module = nnx.merge(fns.eval_graph, params, rest)
        modules.append(module.body if isinstance(module, AuxStage) else module)  # heads dropped
    model = nnx.Sequential(*modules)
    model.eval()
    return model


def save(model: nnx.Module, directory: str | os.PathLike) -> str:
    """Writes the model's weights and statistics (`nnx.state`) to `directory` with orbax;
    returns the absolute path written.

    >>> import os, tempfile
    >>> from flax import nnx
    >>> from dgrad import models
    >>> model = nnx.Sequential(*models.mlp([4, 8, 3], num_stages=2))
    >>> path = save(model, os.path.join(tempfile.mkdtemp(), "model"))
    >>> os.path.isabs(path), os.path.isdir(path)
    (True, True)
    """
    path = os.path.abspath(os.fspath(directory))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, nnx.state(model), force=True)
    return path


def load(stages: Sequence[nnx.Module], directory: str | os.PathLike) -> nnx.Sequential:
    """The model `save` wrote, given freshly built stages of the same architecture and split.

    >>> import tempfile, jax.numpy as jnp
    >>> from flax import nnx
    >>> from dgrad import models
    >>> original = nnx.Sequential(*models.mlp([4, 8, 3], num_stages=2, rngs=0))
    >>> path = save(original, tempfile.mkdtemp() + "/model")
    >>> loaded = load(models.mlp([4, 8, 3], num_stages=2, rngs=1), path)  # other weights
    >>> bool(jnp.array_equal(loaded(jnp.ones((2, 4))), original(jnp.ones((2, 4)))))
    True
    """
    model = nnx.Sequential(*stages)
    model.eval()
    graph, abstract = nnx.split(model)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(
            os.path.abspath(os.fspath(directory)),
            jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract),
        )
    return nnx.merge(graph, restored)
