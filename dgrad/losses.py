"""Loss heads for the last pipeline stage.

A loss function maps `(outputs, labels)` to `(scalar_loss, metrics_dict)`; the
last stage differentiates the scalar and reports both.

>>> import jax.numpy as jnp
>>> loss, metrics = softmax_cross_entropy(jnp.array([[2.0, 0.0]]), jnp.array([0]))
>>> round(float(loss), 4), float(metrics["accuracy"])
(0.1269, 1.0)
"""

from __future__ import annotations

import jax.numpy as jnp
import optax


def softmax_cross_entropy(logits, labels):
    """Mean cross-entropy of integer `labels` under `logits`, plus accuracy.

    >>> import jax.numpy as jnp
    >>> logits, labels = jnp.array([[2.0, 0.0], [2.0, 0.0]]), jnp.array([0, 1])
    >>> loss, metrics = softmax_cross_entropy(logits, labels)  # -log(0.88) and -log(0.12)
    >>> round(float(loss), 4), float(metrics["accuracy"])
    (1.1269, 0.5)
    """
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    accuracy = (jnp.argmax(logits, axis=-1) == labels).mean()
    return loss, {"accuracy": accuracy}
