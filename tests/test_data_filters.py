"""Metadata filters parsed into predicates (never eval), and the dataset config validation."""

from __future__ import annotations

import pytest
from data_fixtures import make_cfg
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError

from sd_training.data import DatasetConfig, DatasetConfigError, validate_dataset_config
from sd_training.data.filters import parse_filter, parse_filters


@pytest.mark.parametrize(
    "expr, value, expected",
    [
        ("<=0.5", 0.5, True),
        ("<=0.5", 0.51, False),
        ("< 0.5", 0.49, True),
        (">=512", 512, True),
        (">=512", 511, False),
        (">512", "600", True),  # a number stored as a string still compares as a number
        ("==3", 3.0, True),
        ("!= 3", 4, True),
        ("== success", "success", True),
        ("== 'a b'", "a b", True),
        ('!= "x"', "x", False),
        ("== true", True, True),
        ("== true", 1, False),  # booleans are not numbers
        ("in [a, b, 'c d']", "c d", True),
        ("in [1, 2]", 2.0, True),
        ("in [1, 2]", "z", False),
        ("not in [nsfw, unsafe]", "safe", True),
        ("not in [nsfw, unsafe]", "nsfw", False),
        ("<=0.5", "n/a", False),  # type mismatch fails, never raises
        ("<=0.5", float("nan"), False),
        ("<=0.5", [0.1], False),
    ],
)
def test_operators(expr, value, expected):
    assert parse_filter("k", expr)({"k": value}) is expected


def test_missing_null_and_non_dict_metadata_fail():
    f = parse_filter("pwatermark", "<=0.5")
    assert f({}) is False
    assert f({"pwatermark": None}) is False
    assert f(None) is False
    assert f(["pwatermark"]) is False


def test_yaml_scalars_and_lists_and_nested_keys():
    assert parse_filter("nsfw", False)({"nsfw": False})
    assert not parse_filter("nsfw", False)({"nsfw": True})
    assert parse_filter("w", 512)({"w": 512})
    assert parse_filter("lang", ["en", "de"])({"lang": "de"})
    assert parse_filter("exif.w", ">=10")({"exif": {"w": 12}})
    assert not parse_filter("exif.w", ">=10")({"exif": {"h": 12}})


@pytest.mark.parametrize(
    "expr, match",
    [
        ("0.5", "no operator"),
        ("=<0.5", "no operator"),
        ("<=", "empty"),
        ("<= abc", "needs a number"),
        ("in [a, 'b]", "unclosed quote"),
        ("== null", "null is not a filter value"),
        ("__import__('os').system('x')", "no operator"),
        ({"a": 1}, "expected an expression"),
    ],
)
def test_malformed_expressions_stop_start_up_naming_the_key(expr, match):
    with pytest.raises(DatasetConfigError, match=rf"filters\.pwatermark.*{match}|{match}"):
        parse_filters({"pwatermark": expr})
    with pytest.raises(DatasetConfigError, match="pwatermark"):
        validate_dataset_config(make_cfg("x.tar", filters={"pwatermark": expr}))


def test_validation_rejects_keys_for_other_types():
    with pytest.raises(DatasetConfigError, match=r"image_column='img' does not apply to dataset.type=WebDataset"):
        validate_dataset_config(make_cfg("x.tar", image_column="img"))
    with pytest.raises(DatasetConfigError, match=r"caption_key='text' does not apply to dataset.type=parquet"):
        validate_dataset_config(make_cfg("x.parquet", type="parquet", caption_key="text"))
    with pytest.raises(DatasetConfigError, match=r"consider_every_nth=2 does not apply"):
        validate_dataset_config(make_cfg("x.csv", type="CSV", consider_every_nth=2))
    with pytest.raises(DatasetConfigError, match="tags.blacklist_tags is set but tags are not used"):
        validate_dataset_config(make_cfg("x.tar", **{"tags.blacklist_tags": ["a"]}))
    with pytest.raises(DatasetConfigError, match="unknown source 'lmdb'"):
        validate_dataset_config(make_cfg("x", type="lmdb"))
    # The same keys are fine for their own types.
    validate_dataset_config(make_cfg("x.csv", type="csv", image_column="img", csv_separator="\t"))
    validate_dataset_config(make_cfg("d", type="folder", consider_every_nth=3, **{"tags.min_score": 5}))
    validate_dataset_config(make_cfg("x.tar", **{"tags.use_tags": True, "tags.blacklist_tags": ["a"]}))


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("caption_dropout", 1.5, "probability"),
        ("random_flip", -0.1, "probability"),
        ("resolution", 100, "multiple of 8"),
        ("batch_size", 0, ">= 1"),
        ("shuffle_buffer", 0, ">= 1"),
        ("layout", "tree", "auto, flat or metadata"),
        ("idx_to_prompt", "no_such_mapping.json", "no such file"),
        ("idx_to_prompt", {"zero": "x"}, "not a class index"),
    ],
)
def test_validation_ranges(key, value, match):
    kind = "folder" if key == "layout" else "WebDataset"
    with pytest.raises(DatasetConfigError, match=match):
        validate_dataset_config(make_cfg("x.tar", type=kind, **{key: value}))


def test_validation_works_on_an_omegaconf_structured_config():
    cfg = OmegaConf.structured(DatasetConfig)
    cfg.params.path = "x.tar"
    cfg.params.filters = {"pwatermark": "<=0.5", "original_width": ">=512"}
    cfg.params.batch_size = 2
    cfg.params.workers = 0
    with pytest.raises(DatasetConfigError, match="system.batch_size|experiment.num_examples_to_see"):
        validate_dataset_config(cfg)  # ${experiment.num_examples_to_see} has nothing to resolve against
    cfg.params.num_examples_to_see = 100
    validate_dataset_config(cfg)
    cfg.params.filters = {"pwatermark": "<=0.5", "original_width": "big"}
    with pytest.raises(DatasetConfigError, match="original_width"):
        validate_dataset_config(cfg)
    with pytest.raises(ConfigAttributeError):  # unknown keys are rejected by the schema itself
        cfg.params.not_a_key = 1
