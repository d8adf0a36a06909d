"""Golden-label dumps: the doc file format, its atomic writer and reader, and the dump client."""

from flashmemory.dump.format import DumpDoc, DumpFormatError, doc_filename, list_docs, load_doc, read_metadata
from flashmemory.dump.writer import DumpWriter, save_doc_file

__all__ = [
    "DumpDoc",
    "DumpFormatError",
    "DumpWriter",
    "doc_filename",
    "list_docs",
    "load_doc",
    "read_metadata",
    "save_doc_file",
]
