"""Per-request dump control between `flashmemory dump --backend sglang` and a dump-mode sglang server.

The client sends OpenAI chat completions whose JSON body carries (what the openai client sends for
`extra_body={"custom_params": {"flashmemory_dump": {...}}}`):

    "custom_params": {"flashmemory_dump": {"version": 1, "pass": 1 | 2, "doc_index": int,
        "output_dir": "/abs/staging", "topp": float, "min_layers": int,
        "target_csa_layers": [c4 ids], "n_logit_tokens": 3}}

No shared /tmp command file: each request says what to record. The server (dump mode,
SGLANG_FLASHMEMORY_DUMP=1) records that request only and, when it finishes, writes with
`flashmemory.dump.writer.save_doc_file` (atomic):
  pass 1: `{output_dir}/pass1/doc_{doc_index:05d}.safetensors`, a full document (hidden, positions,
          labels over all c4 layers, first-token logits, compk of what it has);
  pass 2: `{output_dir}/pass2/doc_{doc_index:05d}.safetensors`, whose `compk_layer_{L}` cover
          prompt + response (the client only reads those keys).
The client polls for the file, merges pass-2 keys into pass 1 and commits the document itself.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

PARAM_KEY = "flashmemory_dump"
VERSION = 1


class DumpProtocolError(ValueError):
    """A `flashmemory_dump` request field is missing or invalid."""


@dataclass(frozen=True)
class DumpRequest:
    pass_: int
    doc_index: int
    output_dir: str
    topp: float = 0.6
    min_layers: int = 3
    target_csa_layers: tuple[int, ...] = (10, 12, 20)
    n_logit_tokens: int = 3
    version: int = VERSION

    def __post_init__(self) -> None:
        if self.pass_ not in (1, 2):
            raise DumpProtocolError(f"{PARAM_KEY}.pass={self.pass_}: expected 1 or 2")
        if self.doc_index < 0:
            raise DumpProtocolError(f"{PARAM_KEY}.doc_index={self.doc_index}: must be >= 0")
        if not Path(self.output_dir).is_absolute():
            raise DumpProtocolError(f"{PARAM_KEY}.output_dir={self.output_dir!r}: must be absolute (the server writes it)")
        if not 0.0 <= self.topp <= 1.0:
            raise DumpProtocolError(f"{PARAM_KEY}.topp={self.topp}: must lie in [0, 1]")
        if self.min_layers < 1 or not self.target_csa_layers:
            raise DumpProtocolError(f"{PARAM_KEY}: min_layers >= 1 and a non-empty target_csa_layers are required")

    def to_custom_params(self) -> dict:
        d = asdict(self)
        d["pass"] = d.pop("pass_")
        d["target_csa_layers"] = list(self.target_csa_layers)
        return {PARAM_KEY: d}

    @classmethod
    def from_custom_params(cls, custom_params: dict | None) -> "DumpRequest | None":
        """Parse a request's custom_params; None when it carries no dump block (a normal request)."""
        if not custom_params or PARAM_KEY not in custom_params:
            return None
        d = custom_params[PARAM_KEY]
        if not isinstance(d, dict):
            raise DumpProtocolError(f"{PARAM_KEY}: expected an object, got {type(d).__name__}")
        missing = [k for k in ("pass", "doc_index", "output_dir") if k not in d]
        if missing:
            raise DumpProtocolError(f"{PARAM_KEY}: missing field(s) {missing}")
        if int(d.get("version", VERSION)) != VERSION:
            raise DumpProtocolError(f"{PARAM_KEY}.version={d['version']}: this side speaks version {VERSION}")
        try:
            return cls(pass_=int(d["pass"]), doc_index=int(d["doc_index"]), output_dir=str(d["output_dir"]),
                       topp=float(d.get("topp", 0.6)), min_layers=int(d.get("min_layers", 3)),
                       target_csa_layers=tuple(int(x) for x in d.get("target_csa_layers", (10, 12, 20))),
                       n_logit_tokens=int(d.get("n_logit_tokens", 3)))
        except (TypeError, ValueError) as e:
            if isinstance(e, DumpProtocolError):
                raise
            raise DumpProtocolError(f"{PARAM_KEY}: bad field value ({e})") from None

    def doc_path(self) -> Path:
        """Where the server writes this request's file."""
        return Path(self.output_dir) / f"pass{self.pass_}" / f"doc_{self.doc_index:05d}.safetensors"
