"""dgrad.train.export: the merged model predicts as the pipeline did, and saves and loads."""

import jax
import numpy as np
import pytest
from helpers import batches, build_pipeline, build_stages

from dgrad.train import export


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fdg", pytest.param("ddg", marks=pytest.mark.slow)])
def test_merged_model_predicts_like_the_pipeline(tmp_path, method):
    data = batches("cnn", 7)
    pipe = build_pipeline("cnn", 3, method=method, devices=jax.devices()[1:4])
    state = pipe.init(data[0])
    for batch in data:
        state, _ = pipe.step(state, batch)
    model = export.merge(pipe, state, device=jax.devices()[0])
    outputs = model(data[0][0])
    assert outputs.devices() == {jax.devices()[0]}
    np.testing.assert_allclose(
        np.asarray(outputs), np.asarray(pipe.predict(state, data[0][0])), rtol=1e-6, atol=1e-6
    )
    # BatchNorm statistics came along (the initial stages have other ones).
    fresh = export.merge(pipe, pipe.init(data[0]))
    assert not np.allclose(np.asarray(fresh(data[0][0])), np.asarray(outputs))

    path = export.save(model, tmp_path / "model")
    loaded = export.load(build_stages("cnn", 3), path)
    np.testing.assert_array_equal(np.asarray(loaded(data[0][0])), np.asarray(outputs))
