"""Every module's docstring examples run and say what they show, and every public
function and class has an example of its own; a public method has one of its own or is
called in its class's."""

import doctest
import importlib
import inspect
import pkgutil

import pytest

import dgrad

ALL_MODULES = ["dgrad"] + sorted(
    module.name for module in pkgutil.walk_packages(dgrad.__path__, prefix="dgrad.")
)
MODULES = [name for name in ALL_MODULES if name != "dgrad"]
WITHOUT_EXAMPLES = {
    "dgrad.models",  # only imports: the examples are in its modules
    "dgrad.measure",  # only its modules' list: the examples are in its modules
    "dgrad.train",  # only re-exports: `train`'s examples are in dgrad.train.experiment
    "dgrad.train.config",  # only re-exports: the examples are in its modules
}

# Public names that need no example of their own: a module name stands for every
# name defined in it. Keep this short; each entry says why.
ALLOWED_WITHOUT_EXAMPLE: set[str] = {
    # start four processes: tests/test_benchmark.py runs them
    "dgrad.measure.benchmark_across.compare_across_processes",
    "dgrad.measure.benchmark_command.compare_with_command",
    # each needs a started worker process: the class's example calls them
    "dgrad.measure.benchmark_across.Group.window",
    "dgrad.measure.benchmark_across.Group.moves",
    "dgrad.measure.benchmark_across.Group.close",
    # whole benchmark runs: tests/test_benchmark.py runs them through the command
    "dgrad.measure.report.engine",
    "dgrad.measure.report.across",
    "dgrad.measure.report.against_command",
    "dgrad.measure.report.serve",
    # records with nothing to compute; the example of the function named makes them
    "dgrad.measure.benchmark_command.Measured",  # compare_with_command (test_benchmark)
    "dgrad.data.text.Corpus",  # stdlib_corpus
    "dgrad.train.config.runs.Run",  # runs_of
    "dgrad.train.loop.RunContext",  # train_run
    "dgrad.train.loop.Due",  # due_after
    "dgrad.train.sweep.Quantity",  # quantity_of
}


def test_every_module_is_listed():
    assert "dgrad.pipeline" in MODULES and "dgrad.train.checkpoint" in MODULES


# Modules whose examples train, start processes or build the GPT: the full suite runs
# them, the fast subset (-m "not slow") does not.
SLOW_EXAMPLES = {
    "dgrad.measure.benchmark_across",
    "dgrad.measure.benchmark_command",
    "dgrad.models.gpt",
    "dgrad.measure.stress",
    "dgrad.train.experiment",
}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_EXAMPLES else n for n in MODULES],
)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    if name not in WITHOUT_EXAMPLES:
        assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0


def _methods(cls):
    """The public methods `cls` itself defines: not inherited, not generated (a dataclass's
    `replace`), not properties or dunders."""
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if inspect.isfunction(member) and member.__qualname__ == f"{cls.__qualname__}.{name}":
            yield name, member


def public_names(module_name):
    """`(dotted name, object, where its use may be shown instead)` of each public function
    and class defined in the module (None), and of each public method those classes define
    (the class's docstring, where a call `.method(` shows it)."""
    module = importlib.import_module(module_name)
    for name, obj in vars(module).items():
        if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        if obj.__module__ != module_name:  # imported from elsewhere
            continue
        yield f"{module_name}.{name}", obj, None
        if inspect.isclass(obj):
            for method_name, method in _methods(obj):
                yield f"{module_name}.{name}.{method_name}", method, obj.__doc__ or ""


def _shown(obj, method_name: str, class_doc: str | None) -> bool:
    """Whether `obj` has an example of its own, or is a method its class's example calls."""
    if ">>>" in (obj.__doc__ or ""):
        return True
    lines = (class_doc or "").splitlines()
    examples = [line for line in lines if line.lstrip().startswith((">>>", "..."))]
    return class_doc is not None and any(f".{method_name}(" in line for line in examples)


def _allowed(dotted):
    return any(
        dotted == entry or dotted.startswith(entry + ".") for entry in ALLOWED_WITHOUT_EXAMPLE
    )


@pytest.mark.parametrize("module_name", ALL_MODULES)
def test_every_public_name_has_an_example(module_name):
    missing = [
        dotted
        for dotted, obj, class_doc in public_names(module_name)
        if not _allowed(dotted) and not _shown(obj, dotted.rsplit(".", 1)[1], class_doc)
    ]
    assert not missing, (
        "These public names have no `>>>` example in their own docstring, nor (methods) a "
        "call in their class's example (add one, or an entry with its reason to "
        "ALLOWED_WITHOUT_EXAMPLE): " + ", ".join(missing)
    )


def test_the_allow_list_is_current():
    names = {dotted for module in ALL_MODULES for dotted, _, _ in public_names(module)}
    for entry in ALLOWED_WITHOUT_EXAMPLE:
        assert entry in ALL_MODULES or entry in names, f"{entry} is no longer a public name"


def test_a_method_is_shown_only_by_its_own_example_or_a_call_in_its_class_s():
    class Counter:
        """Counts.

        Calls .total( in prose, not in an example.

        >>> Counter().add(2)
        """

        def add(self, n):
            """Adds `n`."""

        def total(self):
            """The sum."""

        def reset(self):
            """Starts again.

            >>> Counter().reset()
            """

    doc = Counter.__doc__
    assert _shown(Counter.add, "add", doc) and _shown(Counter.reset, "reset", doc)
    assert not _shown(Counter.total, "total", doc)
    assert not _shown(Counter.add, "add", None)  # a function: its own example only
