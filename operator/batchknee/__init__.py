"""batchknee: keep LLM engines' decode batch limit at the memory-bandwidth knee."""

__version__ = "0.1.0"
