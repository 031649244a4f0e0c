"""Bytes per element of the weight and KV-cache data types engines accept."""

from __future__ import annotations

_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "float32": 4.0,
    "bf16": 2.0,
    "bfloat16": 2.0,
    "fp16": 2.0,
    "float16": 2.0,
    "half": 2.0,
    "fp8": 1.0,
    "fp8_e4m3": 1.0,
    "fp8_e5m2": 1.0,
    "int8": 1.0,
    "int4": 0.5,
}

WEIGHT_DTYPES = ("bf16", "fp16", "fp8", "int8", "int4")
KV_DTYPES = ("auto", "bf16", "fp16", "fp8", "fp8_e4m3", "fp8_e5m2")


def dtype_bytes(name: str) -> float:
    """Bytes per element of `name` (case-insensitive); ValueError lists the known names."""
    key = name.strip().lower()
    if key not in _BYTES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(sorted(_BYTES))}")
    return _BYTES[key]


def kv_dtype_bytes(kv_dtype: str, weight_dtype: str) -> float:
    """KV-cache bytes per element. `auto` follows the model's activation dtype, as vLLM does:
    16-bit even for fp8/int4 weight-quantized models, whose activations stay in bf16/fp16."""
    if kv_dtype.strip().lower() == "auto":
        return max(2.0, dtype_bytes(weight_dtype))
    if kv_dtype.strip().lower() == "int4":
        raise ValueError(
            "kv dtype 'int4' is not supported by vLLM or TensorRT-LLM; use auto, bf16, fp16 or fp8"
        )
    return dtype_bytes(kv_dtype)
