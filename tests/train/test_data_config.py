"""Data configs: relative paths, YAML, and clear errors for bad files."""

from __future__ import annotations

import json

import pytest

from flashmemory.train.data_config import DataConfigError, load_data_config


def test_relative_dirs_resolve_against_config_dir(tmp_path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "sub").mkdir()
    cfg = tmp_path / "sub" / "c.json"
    cfg.write_text(json.dumps({"train": [{"data_dir": "../a", "doc_ids": [3, 1, 1]}], "val": ["../a"]}))
    dc = load_data_config(cfg)
    assert dc.train[0].data_dir == (tmp_path / "a").resolve()
    assert dc.train[0].doc_ids == (1, 3)
    assert dc.val[0].doc_ids is None and dc.test == ()


def test_yaml_config(tmp_path) -> None:
    (tmp_path / "d").mkdir()
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  - data_dir: d\n    doc_ids: null\nval:\n  - data_dir: d\n")
    assert load_data_config(cfg).val[0].data_dir == (tmp_path / "d").resolve()


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"train": [{"data_dir": "nope"}], "val": [{"data_dir": "nope"}]}, "train[0]: data_dir 'nope'"),
        ({"train": [{"data_dir": "d"}], "val": []}, "split 'val' is empty"),
        ({"train": [{"data_dir": "d", "doc_id": [1]}], "val": ["d"]}, "unknown key(s) ['doc_id']"),
        ({"train": [{"data_dir": "d", "doc_ids": [-1]}], "val": ["d"]}, "'doc_ids' must be null or a list"),
        ({"train": ["d"], "val": ["d"], "tset": []}, "unknown split(s) ['tset']"),
        ([1, 2], "top level must be an object"),
    ],
)
def test_bad_config_names_the_problem(tmp_path, body, needle) -> None:
    (tmp_path / "d").mkdir()
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(body))
    with pytest.raises(DataConfigError) as e:
        load_data_config(cfg)
    assert needle in str(e.value) and str(cfg) in str(e.value)


def test_invalid_json_and_missing_file(tmp_path) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text('{"train": [\n  {"data_dir": }]}')
    with pytest.raises(DataConfigError, match=r"invalid JSON at line 2"):
        load_data_config(cfg)
    with pytest.raises(DataConfigError, match="no such file"):
        load_data_config(tmp_path / "missing.json")
