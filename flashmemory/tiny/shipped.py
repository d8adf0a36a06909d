"""Where the shipped trained checkpoint lives (`flashmemory/hf/trained/dsv4-retrieval`)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

TRAINED_NAME = "dsv4-retrieval"


def trained_model_dir() -> Path:
    """Directory of the shipped trained model (config.json + model.safetensors); may be absent in a
    checkout that dropped the weights, so callers check `trained_model_available()`."""
    return Path(str(resources.files("flashmemory.hf").joinpath("trained", TRAINED_NAME)))


def trained_model_available() -> bool:
    d = trained_model_dir()
    return (d / "config.json").is_file() and (d / "model.safetensors").is_file()
