"""dgrad.state: the shapes of what a pipeline carries, predicted from the timetable alone."""

import jax
from helpers import batches, build_pipeline


def test_the_timetable_predicts_the_state_at_every_step():
    """What a checkpoint restores into (`state_structure`) is the live state's structure."""
    for method, memory, microbatches in [
        ("fdg", "residuals", None),
        ("ddg", "recompute", None),
        ("bp", "dots", None),
        ("2bw", "residuals", 2),
        ("1f1b", "recompute", 4),
    ]:
        data = batches("mlp", 9)
        pipe = build_pipeline("mlp", 3, method=method, memory=memory, microbatches=microbatches)
        state = pipe.init(data[0])
        for t, batch in enumerate(data):
            expected = pipe.state_structure(t)
            assert jax.tree.structure(expected) == jax.tree.structure(state), (method, t)
            shapes = jax.tree.map(lambda a: (a.shape, a.dtype), (expected, state))
            assert shapes[0] == shapes[1]
            state, _ = pipe.step(state, batch)
