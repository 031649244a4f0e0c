"""Engine command lines: the flags the operator manages, replaced in the user's args, never duplicated.

Both spellings of a valued flag are recognised, `--max-num-seqs 64` and `--max-num-seqs=64`, and
vLLM's underscore aliases (`--max_num_seqs`): its argument parser accepts either.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

VLLM_PORT = 8000
ENGINE_CONFIG_DIR = "/etc/batchknee"
ENGINE_CONFIG_FILE = "engine.yaml"
ENGINE_CONFIG_PATH = f"{ENGINE_CONFIG_DIR}/{ENGINE_CONFIG_FILE}"

VLLM_MANAGED = ("--max-num-seqs", "--tensor-parallel-size", "--port", "--served-model-name")
TRTLLM_MANAGED = (
    "--max_batch_size",
    "--tp_size",
    "--port",
    "--host",
    "--extra_llm_api_options",
    "--config",
)


def _spellings(flag: str) -> set[str]:
    body = flag.lstrip("-")
    return {f"--{body}", f"--{body.replace('-', '_')}", f"--{body.replace('_', '-')}"}


def _matches(token: str, spellings: set[str]) -> tuple[bool, bool]:
    """(is this flag, does the token carry its own value `--flag=value`)."""
    if token in spellings:
        return True, False
    name, sep, _ = token.partition("=")
    return (True, True) if sep and name in spellings else (False, False)


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of the last `flag` in `args` (either spelling), or None when absent."""
    spellings = _spellings(flag)
    found: str | None = None
    index = 0
    while index < len(args):
        is_flag, inline = _matches(args[index], spellings)
        if is_flag and inline:
            found = args[index].partition("=")[2]
        elif is_flag and index + 1 < len(args):
            found = args[index + 1]
            index += 1
        index += 1
    return found


def strip_flags(args: Sequence[str], flags: Iterable[str]) -> list[str]:
    """`args` without any occurrence of the valued `flags` (either spelling) and their values."""
    spellings = set().union(*(_spellings(flag) for flag in flags))
    kept: list[str] = []
    index = 0
    while index < len(args):
        is_flag, inline = _matches(args[index], spellings)
        if not is_flag:
            kept.append(args[index])
        elif not inline:
            index += 1  # skip its value too
        index += 1
    return kept


def int_flag(args: Sequence[str], flag: str) -> int | None:
    """An integer flag's value; None when absent or not a whole number."""
    value = flag_value(args, flag)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def float_flag(args: Sequence[str], flag: str) -> float | None:
    value = flag_value(args, flag)
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def vllm_command(model: str) -> list[str]:
    return ["vllm", "serve", model]


def vllm_args(
    user_args: Sequence[str],
    *,
    served_model_name: str,
    tensor_parallel: int,
    max_num_seqs: int,
    kv_cache_dtype: str = "auto",
    port: int = VLLM_PORT,
) -> list[str]:
    """The managed flags first, then the user's args without any of them. `--kv-cache-dtype` is
    managed only when the spec asks for a non-default KV dtype (the math assumes it). A user
    `--max-num-batched-tokens` below the batch limit is raised to it (vLLM refuses to start)."""
    managed = list(VLLM_MANAGED)
    if kv_cache_dtype != "auto":
        managed.append("--kv-cache-dtype")
    kept = strip_flags(user_args, managed)
    batched = int_flag(kept, "--max-num-batched-tokens")
    if batched is not None and batched < max_num_seqs:
        kept = [
            *strip_flags(kept, ["--max-num-batched-tokens"]),
            "--max-num-batched-tokens",
            str(max_num_seqs),
        ]
    rendered = [
        "--served-model-name",
        served_model_name,
        "--tensor-parallel-size",
        str(tensor_parallel),
        "--port",
        str(port),
        "--max-num-seqs",
        str(max_num_seqs),
    ]
    if kv_cache_dtype != "auto":
        rendered += ["--kv-cache-dtype", kv_cache_dtype]
    return rendered + kept


def trtllm_command(model: str) -> list[str]:
    return ["trtllm-serve", model]


def trtllm_args(user_args: Sequence[str], *, tensor_parallel: int, port: int = VLLM_PORT) -> list[str]:
    """trtllm-serve's flags: the batch limit lives in the options file, which overrides flags."""
    kept = strip_flags(user_args, TRTLLM_MANAGED)
    return [
        "--host",
        "0.0.0.0",
        "--port",
        str(port),
        "--tp_size",
        str(tensor_parallel),
        "--extra_llm_api_options",
        ENGINE_CONFIG_PATH,
        *kept,
    ]


def vllm_gpu_memory_utilization(user_args: Sequence[str], default: float = 0.9) -> float:
    """The fraction of GPU memory vLLM may use (its KV pool is what is left after the weights)."""
    value = float_flag(user_args, "--gpu-memory-utilization")
    return value if value is not None and 0.0 < value <= 1.0 else default
