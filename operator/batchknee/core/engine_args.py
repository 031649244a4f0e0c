"""Engine command lines: the flags the operator manages, replaced in the user's args, never duplicated.

A managed flag is recognised in every spelling its engine's parser accepts: `--max-num-seqs 64` and
`--max-num-seqs=64`, the underscore forms (`--max_num_seqs`: vLLM's parser swaps `_` and `-` in
names), vLLM's short aliases (`-tp 2`, `-tp=2`), and the unambiguous abbreviations Python's
argparse takes by default (`--max-num-se 8`; vLLM does not turn them off). A flag takes the next
token as its value only when that token is not itself an option (argparse would refuse it), so a
valued flag given without a value never swallows the flag after it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from batchknee.engines import sglang, trtllm, vllm
from batchknee.engines.contract import CommandLine

VLLM_PORT = vllm.HTTP.port
ENGINE_CONFIG_DIR = "/etc/batchknee"
ENGINE_CONFIG_FILE = "engine.yaml"
ENGINE_CONFIG_PATH = f"{ENGINE_CONFIG_DIR}/{ENGINE_CONFIG_FILE}"

VLLM_MANAGED = vllm.MANAGED
TRTLLM_MANAGED = trtllm.MANAGED
SGLANG_MANAGED = sglang.MANAGED
SHORT_ALIASES = vllm.SHORT_ALIASES
VLLM_NEIGHBOURS = vllm.NEIGHBOURS
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
_TOKEN_COUNT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")


def _normal(name: str) -> str:
    """A long option as vLLM's parser sees it: every underscore in its name becomes a dash (a word
    not starting with `--` is left as it is)."""
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def _spellings(flag: str, cli: CommandLine) -> set[str]:
    """The flag and its aliases, normalised: `--max_num-seqs` is `--max-num-seqs` to vLLM."""
    canonical = _normal(flag)
    return {canonical, *(_normal(alias) for alias in cli.aliases.get(canonical, ()))}


def abbreviates(name: str, flag: str, cli: CommandLine) -> bool:
    """Whether argparse would read the long option `name` as an abbreviation of the engine's `flag`
    (or of one of its long aliases)."""
    name = _normal(name)
    if not name.startswith("--") or len(name) < 4:
        return False
    canonical = _normal(flag)
    aliases = cli.aliases.get(canonical, ())
    if not canonical.startswith(name) and not any(alias.startswith(name) for alias in aliases):
        return False  # a prefix of none of its names (most options): nothing more to ask
    targets = {canonical, *(a for a in aliases if a.startswith("--"))}
    targets &= cli.abbreviable
    if not targets or name in targets or not any(t.startswith(name) for t in targets):
        return False
    return not any(other not in targets and other.startswith(name) for other in cli.abbreviable)


def _matches(token: str, flag: str, spellings: set[str], cli: CommandLine) -> tuple[bool, bool]:
    """(is this `flag` — `spellings`, normalised — in any spelling, does the token carry its own
    value `--flag=value`)."""
    if not token.startswith("-"):  # a value
        return False, False
    name, sep, _ = token.partition("=")
    if _normal(name) in spellings or abbreviates(name, flag, cli):
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

    @property
    def as_given(self) -> str:
        """The use as the args spell it: `--flag=8`, `--flag 8`."""
        return self.written if self.width == 1 else f"{self.written} {self.value}"


def flag_uses(args: Sequence[str], flag: str, cli: CommandLine = vllm.COMMAND_LINE) -> list[FlagUse]:
    """Every occurrence of the valued `flag` (any spelling) in `args`."""
    uses: list[FlagUse] = []
    spellings = _spellings(flag, cli)
    index = 0
    while index < len(args):
        is_flag, inline = _matches(args[index], flag, spellings, cli)
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


def flag_value(args: Sequence[str], flag: str, cli: CommandLine = vllm.COMMAND_LINE) -> str | None:
    """The value of the last `flag` in `args` (any spelling), or None when absent."""
    values = [use.value for use in flag_uses(args, flag, cli) if use.value is not None]
    return values[-1] if values else None


def strip_flags(args: Sequence[str], flags: Iterable[str], cli: CommandLine = vllm.COMMAND_LINE) -> list[str]:
    """`args` without any occurrence of the valued `flags` (any spelling) and their values."""
    dropped: set[int] = set()
    for flag in flags:
        for use in flag_uses(args, flag, cli):
            dropped.update(range(use.index, use.index + use.width))
    return [arg for index, arg in enumerate(args) if index not in dropped]


def overridden_flags(
    user_args: Sequence[str],
    rendered_args: Sequence[str],
    flags: Iterable[str],
    cli: CommandLine = vllm.COMMAND_LINE,
) -> list[str]:
    """The user's uses of `flags` that the rendered command line replaces with another value, as
    `<as written> <value> → <rendered value>` (or `→ removed`)."""
    notes: list[str] = []
    for flag in flags:
        rendered = flag_value(rendered_args, flag, cli)
        for use in flag_uses(user_args, flag, cli):
            if use.value == rendered:
                continue
            notes.append(f"{use.as_given} → {rendered if rendered is not None else 'removed'}")
    return notes


# Past this a number read from args is no setting (8 PiB as bytes) and would overflow the float math
# it feeds (a 400-digit count is a valid int): read as not a number, like any other garbage.
MAX_READ_NUMBER = 2**53


def int_flag(args: Sequence[str], flag: str, cli: CommandLine = vllm.COMMAND_LINE) -> int | None:
    """An integer flag's value; None when absent or not a whole number within ±MAX_READ_NUMBER."""
    value = flag_value(args, flag, cli)
    try:
        number = int(value) if value is not None else None
    except ValueError:
        return None
    return number if number is not None and abs(number) <= MAX_READ_NUMBER else None


def human_readable_int(text: str) -> int | None:
    """A positive count as vLLM's `human_readable_int` reads it (`2048`, `2k` = 2,000, `2K` = 2,048,
    `0.5m`, `1G`; decimals only with the decimal suffixes; else what int() takes); None otherwise."""
    match = _TOKEN_COUNT.fullmatch(text.strip())
    if match is None:
        try:
            count = int(text)
        except ValueError:
            return None
        return count if 0 < count <= MAX_READ_NUMBER else None
    number, suffix = match.groups()
    if suffix.islower():
        scaled = float(number) * 1000 ** ("kmgt".index(suffix) + 1)
        count = int(scaled) if math.isfinite(scaled) else 0
    elif number.isdigit():
        count = int(number) * 1024 ** ("KMGT".index(suffix) + 1)
    else:
        return None
    return count if 0 < count <= MAX_READ_NUMBER else None


def token_count_flag(args: Sequence[str], flag: str, cli: CommandLine = vllm.COMMAND_LINE) -> int | None:
    """A count flag's value in vLLM's human-readable forms; None when absent or not one."""
    value = flag_value(args, flag, cli)
    return human_readable_int(value) if value is not None else None


def float_flag(args: Sequence[str], flag: str, cli: CommandLine = vllm.COMMAND_LINE) -> float | None:
    """A number flag's value; None when absent or not a finite number (`1e400` reads as infinity)."""
    value = flag_value(args, flag, cli)
    try:
        number = float(value) if value is not None else None
    except ValueError:
        return None
    return number if number is not None and math.isfinite(number) else None


def vllm_command(model: str) -> list[str]:
    return [vllm.PROGRAM, "serve", model]


def vllm_args(
    user_args: Sequence[str],
    *,
    served_model_name: str,
    tensor_parallel: int,
    max_num_seqs: int,
    kv_cache_dtype: str = "auto",
    port: int = VLLM_PORT,
    shutdown_timeout: int | None = None,
) -> list[str]:
    """The managed flags first, then the user's args without any of them. `--kv-cache-dtype` is
    managed only when the spec asks for a non-default KV dtype (the math assumes it). A user
    `--max-num-batched-tokens` below the batch limit is raised to it (vLLM refuses to start), and a
    `--max-num-active-seqs` is removed: the batch limit is `--max-num-seqs` alone. `shutdown_timeout`
    goes as `--shutdown-timeout` unless the user's args say how long themselves."""
    managed = [*VLLM_MANAGED, *vllm.STRIPPED]
    if kv_cache_dtype != "auto":
        managed.append("--kv-cache-dtype")
    kept = strip_flags(user_args, managed)
    batched = token_count_flag(kept, "--max-num-batched-tokens")
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
    if shutdown_timeout is not None and flag_value(kept, vllm.SHUTDOWN_TIMEOUT_FLAG) is None:
        rendered += [vllm.SHUTDOWN_TIMEOUT_FLAG, str(shutdown_timeout)]
    return rendered + kept


def trtllm_command(model: str) -> list[str]:
    return [trtllm.PROGRAM, model]


def trtllm_args(user_args: Sequence[str], *, tensor_parallel: int, port: int = VLLM_PORT) -> list[str]:
    """trtllm-serve's flags: the batch limit lives in the options file, which overrides flags."""
    kept = strip_flags(user_args, TRTLLM_MANAGED, trtllm.COMMAND_LINE)
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


def vllm_gpu_memory_utilization(
    user_args: Sequence[str], default: float = vllm.DEFAULT_GPU_MEMORY_UTILIZATION
) -> float:
    """The fraction of GPU memory vLLM may use (its KV pool is what is left after the weights)."""
    value = float_flag(user_args, "--gpu-memory-utilization")
    return value if value is not None and 0.0 < value <= 1.0 else default


def sglang_command() -> list[str]:
    return [sglang.PROGRAM, "-m", sglang.MODULE]


def sglang_args(
    user_args: Sequence[str],
    *,
    model: str,
    tensor_parallel: int,
    max_running_requests: int,
    port: int = sglang.HTTP.port,
) -> list[str]:
    """The managed flags first (the model, the batch limit, tensor parallel, port, and metrics on),
    then the user's args without any managed flag in any spelling (`--model`, `--tensor-parallel-size`,
    `--max-running-requests=8`, an unambiguous abbreviation). `--host` is managed: the probes and
    Prometheus reach the pod on its IP, not SGLang's default 127.0.0.1."""
    kept = strip_flags(user_args, SGLANG_MANAGED, sglang.COMMAND_LINE)
    rendered = [
        "--model-path",
        model,
        "--max-running-requests",
        str(max_running_requests),
        "--tp-size",
        str(tensor_parallel),
        "--host",
        "0.0.0.0",
        "--port",
        str(port),
    ]
    if sglang.METRICS_SWITCH not in kept:
        rendered.append(sglang.METRICS_SWITCH)
    return rendered + kept


def sglang_mem_fraction_static(
    user_args: Sequence[str], default: float = sglang.DEFAULT_MEM_FRACTION_STATIC
) -> float:
    """The fraction of the whole GPU memory SGLang takes for weights and the KV pool."""
    value = float_flag(user_args, "--mem-fraction-static", sglang.COMMAND_LINE)
    return value if value is not None and 0.0 < value <= 1.0 else default
