import pytest

from flashmemory.hf.layers import c4_layer_ids, c4_ratio, check_c4_ids, layer_counts
from flashmemory.hf.models import config_dict, make_config


def test_micro_c4_ids():
    cfg = make_config(config_dict("micro"))
    assert c4_layer_ids(cfg) == [2, 4, 6, 8]
    assert c4_ratio(cfg) == 4
    assert layer_counts(cfg) == {"swa": 2, "c4": 4, "c128": 3}


def test_tiny_flash_schedule_from_config():
    cfg = make_config(config_dict("tiny-flash"))
    ids = c4_layer_ids(cfg)
    assert ids == list(range(2, 43, 2))
    assert {10, 12, 20} <= set(range(len(ids)))
    assert layer_counts(cfg) == {"swa": 2, "c4": 21, "c128": 20}


def test_check_c4_ids():
    assert check_c4_ids([3, 1, 1], 4) == [1, 3]
    with pytest.raises(ValueError, match=r"\[4\] out of range"):
        check_c4_ids([0, 4], 4)
    with pytest.raises(ValueError, match="out of range"):
        check_c4_ids([-1], 4)


def test_c4_layer_ids_rejects_non_v4():
    class NotV4:
        layer_types = None

    with pytest.raises(ValueError, match="layer_types"):
        c4_layer_ids(NotV4())
