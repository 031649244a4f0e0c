"""Engine command lines: the flags the operator manages, replaced in the user's args, never duplicated.

A managed flag is recognised in every spelling its engine's parser accepts: `--max-num-seqs 64` and
`--max-num-seqs=64`, the underscore forms (`--max_num_seqs`: vLLM's parser swaps `_` and `-` in
names), vLLM's short aliases (`-tp 2`, `-tp=2`), and the unambiguous abbreviations Python's
argparse takes by default (`--max-num-se 8`; vLLM does not turn them off). A flag takes the next
token as its value only when that token is not itself an option (argparse would refuse it), so a
valued flag given without a value never swallows the flag after it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

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

# Short aliases from vLLM's own argparse (vllm/engine/arg_utils.py: `-tp`, `-pp`, `-dp`, `-q`).
SHORT_ALIASES: dict[str, tuple[str, ...]] = {
    "--tensor-parallel-size": ("-tp",),
    "--pipeline-parallel-size": ("-pp",),
    "--data-parallel-size": ("-dp",),
    "--quantization": ("-q",),
}
# vLLM long options that share a stem with the managed ones: an abbreviation is a managed flag only
# when it is a prefix of that flag and of none of these (argparse refuses an ambiguous one).
VLLM_NEIGHBOURS = (
    "--max-num-batched-tokens",
    "--max-num-partial-prefills",
    "--max-long-partial-prefills",
    "--max-model-len",
    "--max-logprobs",
    "--max-loras",
    "--max-lora-rank",
    "--max-cpu-loras",
    "--max-parallel-loading-workers",
    "--max-seq-len-to-capture",
    "--tensor-parallel-size",
    "--tokenizer",
    "--tokenizer-mode",
    "--tool-call-parser",
    "--tool-parser-plugin",
    "--trust-remote-code",
    "--task",
    "--port",
    "--pipeline-parallel-size",
    "--preemption-mode",
    "--prefix-caching-hash-algo",
    "--served-model-name",
    "--seed",
    "--scheduling-policy",
    "--scheduler-cls",
    "--kv-cache-dtype",
    "--kv-cache-memory-bytes",
    "--kv-transfer-config",
    "--kv-events-config",
    "--kv-sharing-fast-prefill",
    "--kv-offloading-size",
    "--kv-offloading-backend",
    "--max-num-seqs",
)
_ABBREVIABLE = frozenset(VLLM_NEIGHBOURS)
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def _normal(name: str) -> str:
    """A long option as vLLM's parser sees it: underscores in the name become dashes."""
    return name.replace("_", "-")


def _spellings(flag: str) -> set[str]:
    body = flag.lstrip("-")
    return {
        f"--{body}",
        f"--{body.replace('-', '_')}",
        f"--{body.replace('_', '-')}",
        *SHORT_ALIASES.get(f"--{body.replace('_', '-')}", ()),
    }


def _abbreviates(name: str, flag: str) -> bool:
    """Whether argparse would read the long option `name` as an abbreviation of vLLM's `flag`."""
    flag, name = _normal(flag), _normal(name)
    if flag not in _ABBREVIABLE or not name.startswith("--") or len(name) < 4:
        return False
    if name == flag or not flag.startswith(name):
        return False
    return not any(other != flag and other.startswith(name) for other in _ABBREVIABLE)


def _matches(token: str, flag: str) -> tuple[bool, bool]:
    """(is this `flag` in any spelling, does the token carry its own value `--flag=value`)."""
    spellings = _spellings(flag)
    name, sep, _ = token.partition("=")
    if name in spellings or _abbreviates(name, flag):
        return True, bool(sep)
    return False, False


def is_option(token: str) -> bool:
    """Whether argparse takes `token` for an option rather than a value (negative numbers are values)."""
    return token.startswith("-") and token != "-" and not _NEGATIVE_NUMBER.match(token)


@dataclass(frozen=True)
class FlagUse:
    """One occurrence of a flag in an argument list: as written, and its value (None: none given)."""

    index: int
    written: str
    value: str | None
    width: int  # tokens it occupies (1 or 2)


def flag_uses(args: Sequence[str], flag: str) -> list[FlagUse]:
    """Every occurrence of the valued `flag` (any spelling) in `args`."""
    uses: list[FlagUse] = []
    index = 0
    while index < len(args):
        is_flag, inline = _matches(args[index], flag)
        if not is_flag:
            index += 1
            continue
        if inline:
            uses.append(FlagUse(index, args[index], args[index].partition("=")[2], 1))
            index += 1
        elif index + 1 < len(args) and not is_option(args[index + 1]):
            uses.append(FlagUse(index, args[index], args[index + 1], 2))
            index += 2
        else:  # no value: argparse refuses it; it takes nothing with it
            uses.append(FlagUse(index, args[index], None, 1))
            index += 1
    return uses


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of the last `flag` in `args` (any spelling), or None when absent."""
    values = [use.value for use in flag_uses(args, flag) if use.value is not None]
    return values[-1] if values else None


def strip_flags(args: Sequence[str], flags: Iterable[str]) -> list[str]:
    """`args` without any occurrence of the valued `flags` (any spelling) and their values."""
    dropped: set[int] = set()
    for flag in flags:
        for use in flag_uses(args, flag):
            dropped.update(range(use.index, use.index + use.width))
    return [arg for index, arg in enumerate(args) if index not in dropped]


def overridden_flags(
    user_args: Sequence[str], rendered_args: Sequence[str], flags: Iterable[str]
) -> list[str]:
    """The user's uses of `flags` that the rendered command line replaces with another value, as
    `<as written> <value> → <rendered value>` (or `→ removed`)."""
    notes: list[str] = []
    for flag in flags:
        rendered = flag_value(rendered_args, flag)
        for use in flag_uses(user_args, flag):
            if use.value == rendered:
                continue
            given = use.written if use.width == 1 else f"{use.written} {use.value}"
            notes.append(f"{given} → {rendered if rendered is not None else 'removed'}")
    return notes


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
