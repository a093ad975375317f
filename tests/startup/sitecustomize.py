"""Run at the start of every Python process the tests start (conftest puts this folder on
their PYTHONPATH): lets each process of a multi-process CPU run write the programs it
compiles into the tests' persistent compilation cache.

JAX writes that cache from process 0 only, and on CPU a program's cache key names its
devices, so the processes after the first never found a program there: each of them
compiled every stage function again in every multi-process test (24-25 s of CPU, under
cProfile, for each process of a 4-process ResNet run). Cached and compiled programs are the same
executables; only who may write changes. The patch waits until JAX's compiler module is
imported, so a child that never imports JAX pays nothing, and if JAX's private
`_cache_write` ever changes shape the children only compile as before.
"""

import importlib.abc
import importlib.util
import sys
import warnings

_MODULE = "jax._src.compiler"


def _write_from_every_process(compiler) -> None:
    from jax._src import compilation_cache, config, distributed

    original = getattr(compiler, "_cache_write", None)
    if original is None:
        return

    def cache_write(*args, **kwargs):
        if len(args) != 6 or kwargs:  # not the call this patch knows: JAX's own
            return original(*args, **kwargs)
        cache_key, compile_time_secs, module_name, backend, executable, callbacks = args
        if distributed.global_state.process_id == 0 or callbacks or backend.platform != "cpu":
            return original(*args)
        if compile_time_secs < config.persistent_cache_min_compile_time_secs.value:
            return
        try:  # as JAX's own write: a failed write warns, the compiled program still runs
            compilation_cache.put_executable_and_time(
                cache_key, module_name, executable, backend, int(compile_time_secs)
            )
        except Exception as error:
            warnings.warn(
                f"Error writing persistent compilation cache entry for '{module_name}': "
                f"{type(error).__name__}: {error}",
                stacklevel=2,
            )

    compiler._cache_write = cache_write


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _write_from_every_process(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchOnImport())
