"""The GPU-free engine: a continuous-batching simulation (pure) and, around it, a real-time server
that exports vLLM's or TensorRT-LLM's metrics (`batchknee emulate`)."""

from batchknee.emulator.engine import (
    DECODE,
    DROPPED,
    FINISHED,
    PREFILL,
    REJECTED,
    WAITING,
    Engine,
    EngineConfig,
    EngineConfigError,
    Request,
    trtllm_num_blocks,
    vllm_num_gpu_blocks,
)
from batchknee.emulator.stats import EngineStats, Histogram, percentile
from batchknee.emulator.workload import LoadError, LoadGenerator, LoadSpec, Schedule

__all__ = [
    "DECODE",
    "DROPPED",
    "FINISHED",
    "PREFILL",
    "REJECTED",
    "WAITING",
    "Engine",
    "EngineConfig",
    "EngineConfigError",
    "EngineStats",
    "Histogram",
    "LoadError",
    "LoadGenerator",
    "LoadSpec",
    "Request",
    "Schedule",
    "percentile",
    "trtllm_num_blocks",
    "vllm_num_gpu_blocks",
]
