"""Property tests: the dump-protocol parser, doc loading and the metadata reader on generated malformed
input give their own clear error type or a correct result, never another exception."""

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from flashmemory.dump import DumpFormatError, load_doc, read_metadata
from flashmemory.dump.format import doc_from_tensors
from flashmemory.dump.protocol import PARAM_KEY, DumpProtocolError, DumpRequest
from flashmemory.dump.writer import save_doc_file
from flashmemory.sglang.dump.mode import parse_request

from .synth import make_doc

FIELDS = [
    "version",
    "pass",
    "doc_index",
    "output_dir",
    "topp",
    "min_layers",
    "target_csa_layers",
    "n_logit_tokens",
    "store_topk",
    "topk_interval",
]
ROOT = "/srv/dumps"
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=12
)
field_values = {
    "version": st.sampled_from([1, 2, 3, 2.0, "2"]) | json_values,
    "pass": st.sampled_from([1, 2, 0, 3, 1.0, True]) | json_values,
    "doc_index": st.integers(-3, 10**6) | json_values,
    "output_dir": st.sampled_from([ROOT, ROOT + "/a/.staging", "/etc", ROOT + "/../etc", "rel", "", ROOT + "/x\0y"])
    | st.text(max_size=20)
    | json_values,
    "topp": st.floats(-1, 2) | json_values,
    "min_layers": st.integers(-2, 40) | json_values,
    "target_csa_layers": st.lists(st.integers(-2, 30), max_size=4) | st.sampled_from(["10", "1,2"]) | json_values,
    "n_logit_tokens": st.integers(-3, 100) | json_values,
    "store_topk": st.sampled_from(["none", "cycle", "all", "x"]) | json_values,
    "topk_interval": st.integers(-2, 100) | json_values,
}
blocks = st.fixed_dictionaries({}, optional={k: v for k, v in field_values.items()})
custom_params = (
    json_values
    | st.builds(lambda b: {PARAM_KEY: b}, blocks)
    | st.builds(
        lambda b, extra: {PARAM_KEY: b, **extra}, blocks, st.dictionaries(st.text(max_size=5), json_values, max_size=2)
    )
)


@SETTINGS
@given(cp=custom_params)
def test_protocol_parser_gives_a_request_or_its_own_error(cp):
    try:
        req = parse_request(cp, rid="r", n_c4_layers=21, root=ROOT)
    except DumpProtocolError as e:
        assert str(e).startswith("request r: ") and "\n" not in str(e)
        return
    if req is None:
        assert cp is None or (isinstance(cp, dict) and PARAM_KEY not in cp)
        return
    assert Path(req.output_dir).is_absolute() and ".." not in Path(req.output_dir).parts
    assert req.output_dir == ROOT or req.output_dir.startswith(ROOT + "/")
    assert req.pass_ in (1, 2) and isinstance(req.doc_index, int) and req.doc_index >= 0
    assert all(type(x) is int and 0 <= x < 21 for x in req.target_csa_layers) and req.target_csa_layers
    assert 1 <= req.min_layers <= 21 and 0 <= req.n_logit_tokens and 0 <= req.topp <= 1
    assert DumpRequest.from_custom_params(req.to_custom_params()) == req  # what the client sends parses back


@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("good") / "doc_00000.safetensors"
    return save_doc_file(p, make_doc(0, P=9, T=3, hidden=4, D=4)).read_bytes()


def _loads_or_clear_error(path):
    try:
        doc = load_doc(path)
    except DumpFormatError as e:
        assert str(path) in str(e)
        return None
    doc.validate()  # a result is a valid document
    return doc


@SETTINGS
@given(data=st.data())
def test_doc_loading_on_mutated_files(tmp_path, good_file, data):
    raw = bytearray(good_file)
    kind = data.draw(st.sampled_from(["truncate", "flip", "header"]))
    if kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif kind == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = data.draw(st.integers(0, 255))
    else:
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n])
        key = data.draw(st.sampled_from(sorted(header)))
        header[key] = data.draw(json_values)
        hb = json.dumps(header).encode()
        raw = bytearray(len(hb).to_bytes(8, "little")) + hb + raw[8 + n :]
    p = tmp_path / "doc_00000.safetensors"
    p.write_bytes(bytes(raw))
    _loads_or_clear_error(p)


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool, torch.int8]
KEYS = [
    "hidden_layer_1",
    "positions_layer_1",
    "compk_layer_1",
    "hidden_layer_2",
    "positions_layer_2",
    "compk_layer_2",
    "label_indices",
    "label_scores",
    "label_pointers",
    "logits_layer_1_token_0",
    "input_ids",
    "native_topk_steps",
    "native_topk_idx_layer_0",
    "native_topk_val_layer_0",
]


@st.composite
def tensors(draw):
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    n = math.prod(shape)
    vals = draw(
        st.lists(
            st.floats(-1e3, 1e3) | st.sampled_from([math.nan, math.inf, -math.inf]) | st.integers(-3, 300),
            min_size=n,
            max_size=n,
        )
    )
    t = torch.tensor(vals, dtype=torch.float64).reshape(shape)
    dt = draw(st.sampled_from(DTYPES))
    return t.to(dt) if dt.is_floating_point else t.nan_to_num(0, 0, 0).clamp(-100, 250).to(torch.int64).to(dt)


@SETTINGS
@given(
    ts=st.dictionaries(st.sampled_from(KEYS), tensors(), max_size=10),
    meta=st.dictionaries(
        st.sampled_from(["doc_index", "n_prompt_blocks", "ratio", "topp", "min_layers", "rid"]),
        st.sampled_from(["0", "1", "4", "-1", "0.6", "nan", "x", "1e400", ""]),
        max_size=6,
    ),
)
def test_doc_from_tensors_on_generated_dicts(ts, meta):
    meta = {"doc_index": "0", "n_prompt_blocks": "0", **meta}
    try:
        doc = doc_from_tensors(ts, meta, "gen")
    except DumpFormatError as e:
        assert str(e).startswith("gen")
        return
    doc.validate()


@SETTINGS
@given(lines=st.lists(json_values.map(json.dumps) | st.text(max_size=30), max_size=5), torn=st.booleans())
def test_metadata_reader_on_generated_lines(tmp_path, lines, torn):
    (tmp_path / "server_metadata.jsonl").write_text("\n".join(lines) + ("" if torn else "\n"))
    try:
        recs = read_metadata(tmp_path)
    except DumpFormatError as e:
        assert "server_metadata.jsonl" in str(e)
        return
    assert len({r["doc_index"] for r in recs}) == len(recs)
    assert all("/" not in r["filename"] and r["filename"] not in ("", ".", "..") for r in recs)
    assume(recs)


@SETTINGS
@given(data=st.data())
def test_doc_from_tensors_on_a_valid_doc_with_keys_replaced_or_dropped(data):
    from flashmemory.dump.writer import doc_tensors

    from .test_topk_store import add_topk

    doc = add_topk(make_doc(0, P=9, T=3, hidden=4, D=4), [0, 2], 3, 2)
    ts, meta = doc_tensors(doc)
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(sorted(ts)))
        if data.draw(st.booleans()):
            ts[key] = data.draw(tensors())
        else:
            del ts[key]
    if data.draw(st.booleans()):
        meta[data.draw(st.sampled_from(sorted(meta)))] = data.draw(st.sampled_from(["-1", "0", "x", "nan", "1e9", ""]))
    try:
        back = doc_from_tensors(ts, meta, "gen")
    except DumpFormatError as e:
        assert str(e).startswith("gen")
        return
    back.validate()
