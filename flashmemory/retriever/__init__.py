"""The Memory Indexer retriever: query encoder, fp8 key codec, YaRN RoPE, Hadamard, checkpoints."""

from flashmemory.retriever.checkpoint import CheckpointError, inspect_checkpoint, load_retriever, save_retriever
from flashmemory.retriever.fp8 import chunk_bytes, chunks_to_pages, dequantize_chunks, pages_to_chunks, quantize_chunks
from flashmemory.retriever.hadamard import hadamard_matrix, hadamard_transform
from flashmemory.retriever.model import JointRetriever, RetrieverDims, RetrieverLayer, relu_head_scores
from flashmemory.retriever.rope import RopeConfig, apply_rope, rope_angles, yarn_correction_range, yarn_inv_freq

__all__ = [
    "CheckpointError",
    "inspect_checkpoint",
    "load_retriever",
    "save_retriever",
    "chunk_bytes",
    "chunks_to_pages",
    "dequantize_chunks",
    "pages_to_chunks",
    "quantize_chunks",
    "hadamard_matrix",
    "hadamard_transform",
    "JointRetriever",
    "RetrieverDims",
    "RetrieverLayer",
    "relu_head_scores",
    "RopeConfig",
    "apply_rope",
    "rope_angles",
    "yarn_correction_range",
    "yarn_inv_freq",
]
