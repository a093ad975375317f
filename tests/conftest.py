"""Test setup: four fake CPU devices (DGRAD_TEST_DEVICES) and a persistent compilation cache.

Both must be configured before JAX runs anything, hence at import time here.
`pytest -m "not slow" -n 2` is the fast subset (each test function once, on two cores; see
`pytest_collection_modifyitems`), and it asks
XLA for its quickest compiles (no backend optimisation: the numbers may differ in the last
bits, and a compile takes about three quarters of the time); the CI runs everything, also on
two cores, compiled as users' runs are.
"""

import os
import tempfile

import jax

# A test that needs more devices reruns itself in a process with DGRAD_TEST_DEVICES set.
jax.config.update("jax_num_cpu_devices", int(os.environ.get("DGRAD_TEST_DEVICES", "4")))
# XLA's CPU compiler is slow on convolution gradients; the many pipelines built
# by the tests compile identical stage functions, which this cache shares.
# The processes the tests start (commands, launchers' children, notebook kernels) read the
# same cache through JAX's environment variables, which they inherit.
CACHE = {
    "JAX_COMPILATION_CACHE_DIR": os.environ.get(
        "DGRAD_TEST_JAX_CACHE", os.path.join(tempfile.gettempdir(), "dgrad-test-jax-cache")
    ),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}
os.environ.update(CACHE)
# ... and each of their processes writes into it, not only process 0 (see startup/sitecustomize.py).
STARTUP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup")
os.environ["PYTHONPATH"] = os.pathsep.join(
    [STARTUP, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
)
jax.config.update("jax_compilation_cache_dir", CACHE["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_configure(config):
    if config.option.markexpr == "not slow":  # before any test builds a device
        flags = os.environ.get("XLA_FLAGS", "")
        if "--xla_backend_optimization_level" not in flags:  # xdist's workers inherit it
            os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()


def pytest_collection_modifyitems(config, items):
    """Tests marked `processes` run several processes at once; xdist (`--dist loadgroup`)
    gives them all to one worker, one after another, so that no two of them share the two
    cores while the other worker runs the in-process tests.

    The fast subset runs each test function once: a parametrized test's cases after its
    first fast one are `slow`, as are the tests marked so (whole training commands, the runs that
    start processes of their own). The CI runs every case.
    """
    import pytest

    seen = set()
    for item in items:
        if item.get_closest_marker("processes"):
            item.add_marker(pytest.mark.xdist_group("processes"))
        function = (item.path, getattr(item, "originalname", item.name))
        if hasattr(item, "callspec") and function in seen:
            item.add_marker(pytest.mark.slow)
        elif not item.get_closest_marker("slow"):
            seen.add(function)
