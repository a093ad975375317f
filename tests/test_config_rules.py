"""The config's rules: fields, overrides, recipes, runs, saved configs and the command's flags."""

import contextlib
import io

import pytest

from dgrad.train import cli
from dgrad.train.config import (
    FIELDS,
    RESUMABLE_FIELDS,
    apply_overrides,
    base,
    check,
    differences,
    extension,
    flatten,
    parse_value,
    recipes,
    runs_of,
    to_json,
    unknown_field,
)
from dgrad.train.config.runs import Run

BY_NAME = {field.name: field for field in FIELDS}


def test_the_defaults_pass_the_check():
    assert check(base()) is None


def test_a_field_unset_by_default_takes_its_type_from_kind():
    nesterov = BY_NAME["optimizer.nesterov"]
    assert (nesterov.default, nesterov.type) == (None, bool)
    assert BY_NAME["num_stages"].type is int


def test_fields_that_change_only_how_a_run_is_watched_are_resumable():
    logging = BY_NAME["log_every_steps"]
    assert (logging.default, logging.resumable) == (50, True)
    assert logging.help.startswith("steps between")
    assert "log_every_steps" in RESUMABLE_FIELDS and "num_stages" not in RESUMABLE_FIELDS


def test_a_name_near_no_field_is_pointed_to_the_help():
    assert unknown_field("xyz") == "xyz is not a config field; --help lists them"
    assert unknown_field("num_stage", "config.") == (
        "config.num_stage is not a config field; did you mean config.num_stages?"
    )


def test_flatten_names_nested_fields_by_dotted_name():
    assert flatten({"a": 1, "b": {"c": 2, "d": {"e": 3}}}) == {"a": 1, "b.c": 2, "b.d.e": 3}
    assert flatten(base())["optimizer.learning_rate"] == 0.1


def test_the_check_refuses_shrinking_for_a_method_without_it():
    config = base()
    config.method, config.beta = "ddg", 0.5
    with pytest.raises(ValueError, match=r"^config: beta=0.5 asks for gradient shrinking, which"):
        check(config)


def test_an_overrides_text_is_read_as_its_fields_type():
    assert (parse_value("num_stages", "4"), parse_value("beta", "0.5")) == (4, 0.5)
    assert parse_value("model.hidden", "(64, 32)") == (64, 32)
    assert parse_value("optimizer.boundaries", "[100,150]") == (100, 150)
    for text, value in [("yes", True), ("True", True), ("0", False), ("no", False)]:
        assert parse_value("optimizer.nesterov", text) is value
    # a field unset by default can be unset again
    assert parse_value("optimizer.nesterov", "none") is None
    assert parse_value("optimizer.warmup_epochs", "") is None


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("num_stage", "4", "num_stage is not a config field; did you mean num_stages?"),
        ("num_stages", "abc", "num_stages=abc: expected int"),
        ("optimizer.nesterov", "maybe", "optimizer.nesterov=maybe: expected bool"),
        ("model.hidden", "1,x", "model.hidden=1,x: expected tuple values separated by commas"),
    ],
)
def test_an_override_that_cannot_be_read_says_what_the_field_takes(name, text, message):
    with pytest.raises(ValueError) as raised:
        parse_value(name, text)
    assert str(raised.value) == message


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "--config.num_stages",
            "--config.num_stages: give a value, as in --config.num_stages=VALUE",
        ),
        ("--config.numstages=4", "did you mean --config.num_stages?"),
        ("--config.num_stages=abc", "--config.num_stages=abc: expected int"),
    ],
)
def test_an_override_flag_that_cannot_work_is_named_as_written(override, message):
    config = base()
    with pytest.raises(ValueError, match=message.replace("?", r"\?")):
        apply_overrides(config, ["--config.seed=3", override])


def test_a_papers_setting_has_a_smoke_variant_and_no_other():
    assert recipes.paper("cifar10", "cifar_resnet", 56, variant="smoke").model.depth == 20
    wide = recipes.paper("cifar10", "wide_resnet", 28, variant="smoke")
    assert (wide.model.depth, wide.model.widen, wide.split) == (16, 2, "balanced")
    assert recipes.with_variant(base(), "").num_epochs == 300
    with pytest.raises(ValueError) as raised:
        recipes.with_variant(base(), "tiny")
    assert str(raised.value) == "unknown config variant 'tiny'; the only variant is smoke"


def test_the_authors_choices_fill_only_the_unset_optimizer_fields():
    config = base()
    spec = recipes.resolved_optimizer(config, "fdg")
    assert spec["boundaries"] == (150, 225, 275) and spec["nesterov"] is False
    assert spec["warmup_epochs"] == 0 and spec["clip_norm"] == 0.0
    config.optimizer.nesterov, config.accumulate = False, 2  # a set field stays as set
    spec = recipes.resolved_optimizer(config, "ddg")
    assert (spec["nesterov"], spec["warmup_epochs"], spec["boundaries"]) == (False, 5, (150, 225))
    config.optimizer.boundaries, config.optimizer.warmup_epochs = (10,), 1
    spec = recipes.resolved_optimizer(config, "fdg")
    assert (spec["boundaries"], spec["warmup_epochs"]) == ((10,), 1)


def test_the_baseline_is_cut_as_the_run_only_when_the_optimizer_clips():
    config = base()
    assert runs_of(config) == [Run("fdg_k2", "FDG K=2", "fdg", 2, False)]
    config.baseline = "bp"
    assert runs_of(config)[-1] == Run("bp_fused", "BP (fused)", "bp", 1, True)
    config.optimizer.clip_norm = 1.0  # clipping is per stage
    assert runs_of(config)[-1] == Run("bp_fused", "BP (fused)", "bp", 2, True)


def test_a_resumed_run_may_change_only_how_it_is_watched_and_extend_its_epochs():
    saved = to_json(base())
    config = base()
    config.num_stages, config.log_every_steps = 4, 10
    assert differences(saved, config) == ["num_stages"]
    config.num_epochs += 10
    assert differences(saved, config) == ["num_epochs", "num_stages"]
    assert differences(saved, config, extending=True) == ["num_stages"]
    config.num_epochs -= 20  # fewer epochs is no extension: a change
    assert differences(saved, config, extending=True) == ["num_epochs", "num_stages"]


def test_a_field_added_after_a_run_was_saved_reads_as_its_default():
    older = to_json(base())
    del older["context"], older["optimizer"]["name"]
    assert differences(older, base()) == []


def test_an_extension_is_only_more_epochs_than_were_saved():
    saved, config = to_json(base()), base()
    assert extension(saved, config) is None
    config.num_epochs = 200
    assert extension(saved, config) is None
    config.num_epochs = 400
    assert extension(saved, config) == 300


def test_a_parser_mistake_exits_2_with_one_line_or_raises_the_callers_error():
    parser = cli.OneLineParser(prog="x")
    parser.add_argument("--steps", type=int)
    with contextlib.redirect_stderr(io.StringIO()) as err, pytest.raises(SystemExit) as exit:
        parser.parse_args(["--steps=two"])
    assert exit.value.code == 2
    assert err.getvalue() == (
        "error: argument --steps: invalid int value: 'two' (--help lists the flags)\n"
    )
    with pytest.raises(cli.UsageError, match=r"^--steps takes a number \(--help lists the flags"):
        cli.OneLineParser(prog="x", raises=cli.UsageError).error("--steps takes a number")


def test_the_command_line_refuses_a_missing_config_file_and_flags_it_does_not_know():
    with pytest.raises(cli.UsageError, match=r"^--config nope.py: no such file \(the configs"):
        cli.load_config("nope.py")
    with pytest.raises(cli.UsageError) as raised:
        cli.config_overrides(["--config.seed=3", "--sed=3"])
    assert str(raised.value) == "unknown argument --sed=3 (--help lists the flags)"
