"""Stand-ins for `flashmemory eval live`'s HTTP side: a served-model dir, a retriever file, and sessions that answer
from a table instead of a stack (records, resume, fingerprints and the report are tested without servers)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from flashmemory.eval.live.arms import LiveArm
from flashmemory.eval.live.run import LiveConfig
from flashmemory.eval.live.stack import Completion


@pytest.fixture
def model_dir(tmp_path) -> Path:
    d = tmp_path / "served"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"index_topk": 512, "vocab_size": 1024}))
    (d / "model.safetensors").write_bytes(b"weights-v1")
    (d / "tokenizer.json").write_text("{}")
    return d


@pytest.fixture
def retriever(tmp_path) -> str:
    p = tmp_path / "retriever.safetensors"
    p.write_bytes(b"retriever")
    return str(p)


def small_config(out: Path, model: Path, retriever: str, **kw) -> LiveConfig:
    base = dict(
        out_dir=str(out),
        model=str(model),
        arms=(LiveArm("stock"), LiveArm("FlashMemory", 0.1)),
        retriever=retriever,
        n_per_task=2,
        tasks=("niah_single", "mqar"),
        doc_len=256,
        gen_tokens=6,
        replay="",
    )
    base.update(kw)
    return LiveConfig(**base)


@dataclass
class FakeSession:
    """A started arm that answers `complete` from `answers(arm, prompt)` and counts D's counters like FlashMemory."""

    arm: LiveArm
    answers: object
    log: list = field(default_factory=list)
    recall: float = 0.0
    closed: bool = False
    clock: float = 0.0

    def complete(self, prompt: str, max_tokens: int) -> Completion:
        assert not self.closed
        prompt_ids, out = self.answers(self.arm, prompt, max_tokens)
        self.recall += 4096.0
        self.log.append((self.arm.key, prompt))
        self.clock += 1.0
        return Completion(prompt_ids, out, "")

    def metrics(self, settle_s: float = 10.0) -> dict[str, float]:
        return {"flashmemory_recall_bytes_total": self.recall, "flashmemory_resident_fraction": 0.125}

    def held_s(self) -> float:
        return self.clock

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeOpener:
    """opener(arm) -> FakeSession; keeps every session it made."""

    answers: object
    sessions: list = field(default_factory=list)

    def __call__(self, arm: LiveArm) -> FakeSession:
        s = FakeSession(arm, self.answers)
        self.sessions.append(s)
        return s

    @property
    def requests(self) -> list:
        return [r for s in self.sessions for r in s.log]
