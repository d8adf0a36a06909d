"""The demo's serving stage: prompts cut for the byte-level served tokenizer, and the live counters' table row."""
from flashmemory.demo.serve_stage import chat_prompts, live_table


def test_chat_prompts_keep_roles_and_cut_content():
    msgs = [[{"role": "system", "content": "s" * 10}, {"role": "user", "content": "x" * 50 + "END"}]]
    out = chat_prompts(msgs, 8)
    assert out == [[{"role": "system", "content": "s" * 8}, {"role": "user", "content": "x" * 5 + "END"}]]


def test_live_table_reports_requests_and_counters():
    s = {"kmax": 1, "requests": [{"latency_s": 2.0, "completion_tokens": 8}, {"latency_s": 4.0, "completion_tokens": 8}],
         "metrics": {"flashmemory_resident_fraction": 0.125, "flashmemory_recall_bytes_total": 4096.0,
                     "flashmemory_level1_cycles_total": 3.0}}
    row = live_table(s).splitlines()[2]
    assert row == "| FlashMemory (KMAX 1) | 2 | 3.0 | 16 | 0.125 | 4 | - | 3 |"
