"""The /metrics parser keeps the flashmemory_* samples, sums labelled series and drops non-finite values."""
from flashmemory.serve.client import greedy_params, parse_metrics

TEXT = """# HELP flashmemory_recall_bytes_total Bytes copied host -> device by recalls
# TYPE flashmemory_recall_bytes_total counter
flashmemory_recall_bytes_total 73728.0
flashmemory_resident_fraction{pid="12"} 0.125
flashmemory_level1_cycles_total{pid="12"} 3.0
flashmemory_level1_cycles_total{pid="13"} 2.0
flashmemory_level1_cycle_seconds NaN
sglang:num_running_reqs{model_name="x"} 4.0
"""


def test_parse_metrics():
    m = parse_metrics(TEXT)
    assert m == {"flashmemory_recall_bytes_total": 73728.0, "flashmemory_resident_fraction": 0.125,
                 "flashmemory_level1_cycles_total": 5.0}


def test_greedy_params_ignore_eos():
    assert greedy_params(8) == {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
