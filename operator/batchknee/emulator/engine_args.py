"""The `batchknee emulate` command line: the engine's own flags plus the emulator's.

A pod's command works unchanged: the test kubelet runs
`python -m batchknee emulate --engine vllm <emulator options> <the pod's command[1:] and args>`, so
this accepts an optional leading `serve` word (and `-m vllm.entrypoints.openai.api_server`), the
model as the first positional or `--model`, vLLM's flags (`--max-num-seqs`, …, in dash or underscore
spelling) or trtllm-serve's (`--max_batch_size`, `--extra_llm_api_options FILE.yaml`, …), and
ignores, with a warning, any other flag the real engine would take.

The emulator's own switches for issue 14 are spelt so that no engine flag can be mistaken for them:
`--emulator-runtime-config` and `--emulator-trimtab` serve the runtime endpoints of the engine builds
that have them (vLLM PR #54816's `/v1/runtime_config`, trimtab's `/trimtab/set_knobs`), also set per
pod by `$BATCHKNEE_EMULATOR_LIVE_ENDPOINTS` (`runtime-config`, `trimtab`, comma-separated);
`--fault-step-slowdown K --fault-above-running N` stand for a kernel or memory cliff.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import yaml

from batchknee.argtypes import (
    at_most,
    bandwidth,
    fraction,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    token_count,
    unit_fraction,
)
from batchknee.core.catalog import CatalogError, find_gpu, find_model
from batchknee.core.roofline import DecodeRoofline
from batchknee.emulator.engine import (
    EngineConfig,
    EngineConfigError,
    blocks_for_pool,
    no_kv_memory,
    trtllm_num_blocks,
    vllm_num_gpu_blocks,
)
from batchknee.emulator.workload import DISTRIBUTIONS, MAX_REQUEST_RATE, LoadError, LoadSpec
from batchknee.engines import sglang, vllm
from batchknee.engines import trtllm as trtllm_engine

ENGINES = ("vllm", "trtllm", "sglang")
METRIC_VERSIONS = ("current", "legacy", "both")
GPU_ENV = "BATCHKNEE_EMULATOR_GPU"
LIVE_ENDPOINTS_ENV = "BATCHKNEE_EMULATOR_LIVE_ENDPOINTS"
LIVE_ENDPOINTS = ("runtime-config", "trimtab")
DEFAULT_GPU = "a100-80gb"
DEFAULT_MAX_MODEL_LEN = 8192
MAX_SPEEDUP = 10_000.0


class EngineArgsError(ValueError):
    """A command line the emulator cannot run; the message names the option (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise EngineArgsError(message)


# Flags of the real engines that take no value: ignored, and never allowed to swallow the model.
_VLLM_SWITCHES = {
    "--trust-remote-code", "--enforce-eager", "--enable-chunked-prefill", "--no-enable-chunked-prefill",
    "--disable-log-requests", "--enable-log-requests", "--disable-log-stats", "--enable-lora",
    "--enable-auto-tool-choice", "--disable-custom-all-reduce", "--enable-expert-parallel",
    "--disable-frontend-multiprocessing", "--enable-prompt-tokens-details", "--disable-fastapi-docs",
    "--skip-tokenizer-init", "--disable-sliding-window", "--async-scheduling", "--no-async-scheduling",
    "--enable-server-load-tracking", "--enable-force-include-usage", "--disable-uvicorn-access-log",
    "--return-tokens-as-token-ids", "--enable-request-id-headers", "--enable-sleep-mode",
    "--show-hidden-metrics-for-version", "--calculate-kv-scales",
    "--no-enable-prefix-caching", "--enable-prefix-caching", "--headless", "--api-server-count",
}  # fmt: skip
_TRTLLM_SWITCHES = {
    "--trust-remote-code",
    "--enable-chunked-prefill",
    "--disable-gc",
    "--fail-fast-on-attention-window-too-large",
}
_SGLANG_SWITCHES = {
    "--trust-remote-code", "--enable-torch-compile", "--disable-cuda-graph", "--enable-mixed-chunk",
    "--enable-dp-attention", "--disable-overlap-schedule", "--skip-server-warmup", "--log-requests",
    "--enable-cache-report", "--disable-chunked-prefix-cache", "--enable-hierarchical-cache",
}  # fmt: skip
_SHORT_ALIASES = {alias: flag for flag, aliases in vllm.SHORT_ALIASES.items() for alias in aliases}
_NUMBER = re.compile(r"^-?\d+(\.\d+)?([eE][-+]?\d+)?$")


def _normal(flag: str) -> str:
    name, _, _ = flag.partition("=")
    if name in _SHORT_ALIASES:
        return _SHORT_ALIASES[name]
    if name.startswith("--"):
        return "--" + name[2:].replace("_", "-")
    return name


def _is_option(token: str) -> bool:
    return token.startswith("-") and len(token) > 1 and not _NUMBER.match(token)


# --- the parsers -----------------------------------------------------------------------------


_speedup = at_most(positive_float, MAX_SPEEDUP)
_rate = at_most(non_negative_float, MAX_REQUEST_RATE, f"{MAX_REQUEST_RATE:g} requests/s")


def _emulator_parser(engine: str) -> _Parser:
    parser = _Parser(
        prog=f"batchknee emulate --engine {engine}",
        description=(
            "A GPU-free stand-in for a vLLM or trtllm-serve pod: continuous batching simulated in "
            "real time (× --speedup), with the engine's /metrics. Takes the engine's own command "
            "line (an optional leading `serve`, the model, the engine's flags; other flags of the "
            "real engine are ignored with a warning)."
        ),
    )
    own = parser.add_argument_group("emulator")
    own.add_argument("--engine", choices=ENGINES, default="vllm", help="which engine to be")
    own.add_argument(
        "--gpu", default=None, help=f"catalog GPU name (default: ${GPU_ENV}, else {DEFAULT_GPU})"
    )
    own.add_argument("--speedup", type=_speedup, default=1.0, help="simulated seconds per wall second")
    own.add_argument("--seed", type=int, default=0, help="seed of arrivals, lengths and step noise")
    own.add_argument("--overhead-ms", type=non_negative_float, default=2.0, help="fixed time per step")
    own.add_argument(
        "--bandwidth-efficiency",
        type=unit_fraction,
        default=0.8,
        help="achieved fraction of peak HBM bandwidth",
    )
    own.add_argument(
        "--step-noise", type=non_negative_float, default=0.0, help="lognormal sigma of step-time noise (0–1)"
    )
    own.add_argument("--params", type=positive_float, help="override the model's parameter count")
    own.add_argument("--bandwidth", type=bandwidth, help="override HBM bandwidth, e.g. 2.0TB/s")
    own.add_argument(
        "--startup-delay-s", type=non_negative_float, default=1.0, help="wall seconds before /health is 200"
    )
    own.add_argument(
        "--drain-grace-s",
        type=non_negative_float,
        default=25.0,
        help="on SIGTERM, wall seconds to finish queued and running requests",
    )
    own.add_argument(
        "--drain-linger-s",
        type=non_negative_float,
        default=0.0,
        help="after draining, wall seconds to keep serving /metrics before exiting",
    )
    own.add_argument(
        "--metric-version",
        choices=METRIC_VERSIONS,
        default="current",
        help="vLLM metric names: current (0.12+), legacy (≤0.9: gpu_cache_usage_perc, "
        "time_per_output_token_seconds, gpu_prefix_cache_*, no engine label), both (0.10–0.11)",
    )
    own.add_argument(
        "--max-waiting", type=positive_int, default=10_000, help="queue cap; beyond it requests are rejected"
    )
    own.add_argument("--summary-file", type=Path, help="write the exit summary (JSON) here too")
    live = parser.add_argument_group(
        "live caps and faults (the emulator's own switches; vLLM only for the endpoints)"
    )
    live.add_argument(
        "--emulator-runtime-config",
        action="store_true",
        help="serve GET/PATCH /v1/runtime_config (vLLM PR #54816, dev mode); without it they answer 404",
    )
    live.add_argument(
        "--emulator-trimtab",
        action="store_true",
        help="serve POST /trimtab/set_knobs and GET /trimtab/knobs (a trimtab-patched vLLM); "
        "without it they answer 404",
    )
    live.add_argument(
        "--fault-step-slowdown",
        type=positive_float,
        metavar="K",
        default=None,
        help="multiply the step time by K while more than --fault-above-running sequences run",
    )
    live.add_argument(
        "--fault-above-running",
        type=non_negative_int,
        metavar="N",
        default=None,
        help="the running count above which --fault-step-slowdown applies",
    )
    load = parser.add_argument_group("built-in load (changeable by POST /load or --load-file)")
    load.add_argument("--request-rate", type=_rate, default=0.0, help="Poisson arrivals per simulated second")
    load.add_argument("--concurrency", type=int, default=None, help="closed loop: keep N requests in flight")
    load.add_argument("--prompt-tokens", type=positive_int, default=512)
    load.add_argument("--output-tokens", type=positive_int, default=128)
    load.add_argument("--prompt-distribution", choices=DISTRIBUTIONS, default="fixed")
    load.add_argument("--output-distribution", choices=DISTRIBUTIONS, default="fixed")
    load.add_argument(
        "--prompt-spread", type=non_negative_float, default=0.5, help="uniform ±fraction or lognormal sigma"
    )
    load.add_argument("--output-spread", type=non_negative_float, default=0.5)
    load.add_argument(
        "--prefix-sharing", type=fraction, default=0.0, help="fraction of each prompt shared by all"
    )
    load.add_argument("--load-file", type=Path, help="JSON load, re-read whenever it changes")
    served = parser.add_argument_group("serving")
    served.add_argument("--host", default="127.0.0.1")
    served.add_argument("--port", type=port, default=8000)
    served.add_argument("--model", default=None, help="catalog model name or alias (or the first positional)")
    if engine == "vllm":
        flags = parser.add_argument_group("vLLM flags")
        flags.add_argument("--max-num-seqs", type=positive_int)
        flags.add_argument("--max-num-batched-tokens", type=token_count)
        flags.add_argument(
            vllm.KV_MEMORY_FLAG, type=token_count, default=None, help="the KV pool per GPU, bytes"
        )
        flags.add_argument(
            "--max-num-active-seqs",
            type=positive_int,
            default=None,
            help="cap on the running batch (vLLM 0.34)",
        )
        flags.add_argument(
            "--gpu-memory-utilization", type=unit_fraction, default=vllm.DEFAULT_GPU_MEMORY_UTILIZATION
        )
        flags.add_argument("--block-size", type=positive_int, default=vllm.DEFAULT_BLOCK_SIZE)
        flags.add_argument("--served-model-name", nargs="+", default=None)
        flags.add_argument("--tensor-parallel-size", type=positive_int, default=1)
        flags.add_argument("--pipeline-parallel-size", type=positive_int, default=1)
        flags.add_argument("--kv-cache-dtype", default="auto")
        flags.add_argument("--dtype", default="auto")
        flags.add_argument("--quantization", default=None)
        flags.add_argument("--max-model-len", type=token_count, default=None)
        flags.add_argument("--num-gpu-blocks-override", type=positive_int, default=None)
        flags.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
        flags.add_argument(
            "--disable-cascade-attn",
            action="store_true",
            help="read shared prefix blocks once per sequence, not once per step",
        )
        flags.add_argument(
            vllm.MFU_METRICS_SWITCH, action="store_true", help="count vllm:estimated_read_bytes_per_gpu"
        )
    elif engine == "sglang":
        flags = parser.add_argument_group("SGLang flags (python -m sglang.launch_server, sglang serve)")
        flags.add_argument("--model-path", dest="model", default=None, help="the model (alias --model)")
        flags.add_argument("--max-running-requests", type=positive_int, default=None)
        flags.add_argument(
            "--tp-size", "--tensor-parallel-size", dest="tp_size", type=positive_int, default=1
        )
        flags.add_argument(
            "--mem-fraction-static", type=unit_fraction, default=sglang.DEFAULT_MEM_FRACTION_STATIC
        )
        flags.add_argument("--page-size", type=positive_int, default=sglang.DEFAULT_PAGE_SIZE)
        flags.add_argument("--context-length", type=token_count, default=None)
        flags.add_argument("--max-total-tokens", type=positive_int, default=None)
        flags.add_argument(
            "--chunked-prefill-size", type=positive_int, default=sglang.DEFAULT_CHUNKED_PREFILL_SIZE
        )
        flags.add_argument("--disable-radix-cache", action="store_true")
        flags.add_argument("--enable-metrics", action="store_true")
        flags.add_argument(
            sglang.MFU_METRICS_SWITCH, action="store_true", help="count sglang:estimated_read_bytes_per_gpu"
        )
        flags.add_argument(
            sglang.ALL_SCHEDULERS_SWITCH,
            action="store_true",
            help="every tensor-parallel rank's scheduler writes its gauges (not rank 0's only)",
        )
        flags.add_argument(
            sglang.PRIORITY_SWITCH,
            action="store_true",
            help='queue gauges as a total (priority="") and a breakdown by priority',
        )
        flags.add_argument("--served-model-name", nargs="+", default=None)
        flags.add_argument("--kv-cache-dtype", default="auto")
        flags.add_argument("--dtype", default="auto")
    else:
        flags = parser.add_argument_group("trtllm-serve flags (dash or underscore spelling)")
        flags.add_argument(
            "--max-batch-size", type=positive_int, default=trtllm_engine.DEFAULT_MAX_BATCH_SIZE
        )
        flags.add_argument(
            "--max-num-tokens", type=positive_int, default=trtllm_engine.DEFAULT_MAX_NUM_TOKENS
        )
        flags.add_argument("--max-seq-len", type=positive_int, default=None)
        flags.add_argument("--tp-size", type=positive_int, default=1)
        flags.add_argument(
            "--kv-cache-free-gpu-memory-fraction",
            type=unit_fraction,
            default=trtllm_engine.DEFAULT_FREE_GPU_MEMORY_FRACTION,
        )
        flags.add_argument("--extra-llm-api-options", "--config", dest="extra_llm_api_options", type=Path)
        flags.add_argument("--served-model-name", nargs="+", default=None)
        flags.add_argument("--backend", default="pytorch")
    return parser


def _split(argv: Sequence[str], parser: _Parser) -> tuple[list[str], list[str], list[str]]:
    """Known option tokens (for argparse), positionals, and ignored flags (with their values)."""
    known_flags: set[str] = set()
    switches: set[str] = set()
    for action in parser._actions:
        for flag in action.option_strings:
            known_flags.add(flag)
            if action.nargs == 0:
                switches.add(flag)
    engine_switches = _VLLM_SWITCHES | _TRTLLM_SWITCHES | _SGLANG_SWITCHES
    known: list[str] = []
    positionals: list[str] = []
    ignored: list[str] = []
    index = 0
    tokens = list(argv)
    while index < len(tokens):
        token = tokens[index]
        index += 1
        if (
            token == "-m"
            and index < len(tokens)
            and any(engine in tokens[index] for engine in ("vllm", "tensorrt_llm", "sglang"))
        ):
            index += 1  # `python -m vllm.entrypoints.openai.api_server`, `-m sglang.launch_server`
            continue
        if not _is_option(token):
            positionals.append(token)
            continue
        flag = _normal(token)
        has_value = "=" in token
        if flag in known_flags:
            if has_value or flag in switches:
                known.append(flag + ("=" + token.partition("=")[2] if has_value else ""))
                continue
            known.append(flag)
            if flag in ("--served-model-name",):  # nargs="+": every following non-option word
                while index < len(tokens) and not _is_option(tokens[index]):
                    known.append(tokens[index])
                    index += 1
                continue
            if index < len(tokens):
                known.append(tokens[index])
                index += 1
            continue
        # Unknown: ignore it, and its value unless it is a known switch or the value looks like an option.
        skipped = [token]
        attached = not token.startswith("--") and len(token) > 2  # -O3
        takes_value = not has_value and not attached and flag not in engine_switches
        if takes_value and index < len(tokens) and not _is_option(tokens[index]):
            skipped.append(tokens[index])
            index += 1
        ignored.append(" ".join(skipped))
    return known, positionals, ignored


@dataclass(frozen=True)
class EmulatorSettings:
    """Everything `batchknee emulate` needs, resolved."""

    engine: str
    model: str  # the catalog model
    served_model_name: str
    gpu: str
    config: EngineConfig
    load: LoadSpec
    load_file: Path | None
    speedup: float
    seed: int
    startup_delay_s: float
    drain_grace_s: float
    drain_linger_s: float
    metric_version: str
    host: str
    port: int
    summary_file: Path | None
    cache_info: dict[str, str]
    runtime_config_endpoint: bool = False
    trimtab_endpoint: bool = False
    mfu_metrics: bool = False  # vLLM/SGLang --enable-mfu-metrics: count the bytes read
    metrics_for_all_schedulers: bool = False  # SGLang: every TP rank writes the scheduler's gauges
    priority_scheduling: bool = False  # SGLang: the queue gauges' breakdown by priority
    ignored: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    trtllm: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        c = self.config
        return (
            f"{self.engine} {self.model} (served as {self.served_model_name}) on {self.gpu}"
            f"{f' ×{c.roofline.tensor_parallel}' if c.roofline.tensor_parallel > 1 else ''}: "
            f"max-num-seqs {c.max_num_seqs}, max-num-batched-tokens {c.max_num_batched_tokens}, "
            f"{c.num_gpu_blocks} KV blocks of {c.block_size} tokens ({c.kv_tokens:,} tokens), "
            f"max-model-len {c.max_model_len}, prefix caching {'on' if c.enable_prefix_caching else 'off'}, "
            f"speedup {self.speedup:g}{self._describe_live()}"
        )

    def _describe_live(self) -> str:
        c = self.config
        endpoints = [
            path
            for path, served in (
                ("/v1/runtime_config", self.runtime_config_endpoint),
                ("/trimtab/set_knobs", self.trimtab_endpoint),
            )
            if served
        ]
        text = f", live cap endpoints {' and '.join(endpoints)}" if endpoints else ""
        if c.fault_above_running is not None:
            text += f", fault: step time ×{c.fault_step_slowdown:g} above {c.fault_above_running} running"
        return text


_DTYPES = {"auto": "bf16", "bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "half": "fp16", "fp16": "fp16",
           "float32": "fp32", "float": "fp32", "fp32": "fp32"}  # fmt: skip
_KV_DTYPES = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "bfloat16": "bf16",
              "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16"}  # fmt: skip
_QUANTIZED_WEIGHTS = {"fp8": "fp8", "modelopt": "fp8", "fbgemm_fp8": "fp8", "awq": "int4", "awq_marlin": "int4",
                      "gptq": "int4", "gptq_marlin": "int4", "bitsandbytes": "int4", "int8": "int8"}  # fmt: skip


def load_from_args(args: argparse.Namespace, request_rate: float | None) -> LoadSpec:
    """The built-in load from the load options `emulate` and `simulate` share; LoadError names the field."""
    return LoadSpec(
        request_rate=request_rate or 0.0,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        prompt_distribution=args.prompt_distribution,
        output_distribution=args.output_distribution,
        prompt_spread=args.prompt_spread,
        output_spread=args.output_spread,
        prefix_sharing=args.prefix_sharing,
        concurrency=args.concurrency,
    )


def parse_emulator_args(argv: Sequence[str], environ: dict[str, str] | None = None) -> EmulatorSettings:
    """Parse and resolve; EngineArgsError names the option. `--help` raises SystemExit(0) after
    printing the help."""
    env = os.environ if environ is None else environ
    # `python -m sglang.launch_server …` names its engine itself
    engine = "sglang" if f"{sglang.MODULE}" in argv else "vllm"
    for index, token in enumerate(argv):
        if token == "--engine" and index + 1 < len(argv):
            engine = argv[index + 1]
        elif token.startswith("--engine="):
            engine = token.partition("=")[2]
    if engine not in ENGINES:
        raise EngineArgsError(f"--engine: {engine!r} is not one of {', '.join(ENGINES)}")
    parser = _emulator_parser(engine)
    known, positionals, ignored = _split(argv, parser)
    args = parser.parse_args(known)
    warnings: list[str] = []
    words = list(positionals)
    if words and words[0] == "serve":
        words.pop(0)
    model_name = args.model
    if model_name is None:
        if not words:
            raise EngineArgsError("model: give the model as the first positional argument or --model")
        model_name = words.pop(0)
    if words:
        warnings.append(f"ignoring extra positional arguments: {' '.join(words)}")
    try:
        model = find_model(model_name)
    except CatalogError as error:
        raise EngineArgsError(f"model: {error.args[0]}") from None
    gpu_name = args.gpu or env.get(GPU_ENV) or DEFAULT_GPU
    try:
        gpu = find_gpu(gpu_name)
    except CatalogError as error:
        raise EngineArgsError(f"--gpu: {error.args[0]}") from None
    if args.step_noise > 1.0:
        raise EngineArgsError("--step-noise: must be within [0, 1]")
    if args.concurrency is not None and args.concurrency < 0:
        raise EngineArgsError("--concurrency: must be zero or positive")
    try:
        load = load_from_args(args, args.request_rate)
    except LoadError as error:
        raise EngineArgsError(error.for_command_line()) from None
    if (args.fault_step_slowdown is None) != (args.fault_above_running is None):
        raise EngineArgsError(
            "--fault-step-slowdown and --fault-above-running go together: give both "
            "(e.g. --fault-step-slowdown 3 --fault-above-running 48) or neither"
        )
    runtime_config, trimtab = _live_endpoints(args, env)
    if engine != "vllm" and (runtime_config or trimtab):
        warnings.append(
            f"no runtime endpoint on {'SGLang' if engine == 'sglang' else 'TensorRT-LLM'}: "
            "/v1/runtime_config and /trimtab/* answer 404"
        )
        runtime_config = trimtab = False

    common = {
        "engine": engine,
        "model": model.name,
        "gpu": gpu.name,
        "load": load,
        "load_file": args.load_file,
        "speedup": args.speedup,
        "seed": args.seed,
        "startup_delay_s": args.startup_delay_s,
        "drain_grace_s": args.drain_grace_s,
        "drain_linger_s": args.drain_linger_s,
        "metric_version": args.metric_version,
        "host": args.host,
        "port": args.port,
        "summary_file": args.summary_file,
        "ignored": tuple(ignored),
        "runtime_config_endpoint": runtime_config,
        "trimtab_endpoint": trimtab,
        "mfu_metrics": bool(getattr(args, "enable_mfu_metrics", False)),
        "metrics_for_all_schedulers": bool(getattr(args, "enable_metrics_for_all_schedulers", False)),
        "priority_scheduling": bool(getattr(args, "enable_priority_scheduling", False)),
    }
    served = (args.served_model_name or [model_name])[0]

    def roofline(tp: int, weight_dtype: str, kv_dtype: str, read_shared_once: bool) -> DecodeRoofline:
        try:
            return DecodeRoofline(
                model=model,
                gpu=gpu,
                tensor_parallel=tp,
                weight_dtype=weight_dtype,
                kv_dtype=kv_dtype,
                params=args.params,
                bandwidth_bytes_per_s=args.bandwidth,
                bandwidth_efficiency=args.bandwidth_efficiency,
                overhead_s=args.overhead_ms / 1e3,
                shared_prefix_read_once=read_shared_once,
            )
        except ValueError as error:
            raise EngineArgsError(str(error)) from None

    if engine == "vllm":
        return _vllm(args, common, served, roofline, warnings)
    if engine == "sglang":
        return _sglang(args, common, served, roofline, warnings)
    return _trtllm(args, common, served, roofline, warnings)


def _vllm(
    args: argparse.Namespace, common: dict[str, Any], served: str, roofline: Any, warnings: list[str]
) -> EmulatorSettings:
    dtype = _DTYPES.get(args.dtype.lower())
    if dtype is None:
        raise EngineArgsError(f"--dtype: {args.dtype!r} is not one of {', '.join(sorted(_DTYPES))}")
    if args.quantization:
        quantized = _QUANTIZED_WEIGHTS.get(args.quantization.lower())
        if quantized is None:
            warnings.append(f"--quantization {args.quantization}: not modelled; weights stay {dtype}")
        else:
            dtype = quantized
    kv_dtype = _KV_DTYPES.get(args.kv_cache_dtype.lower())
    if kv_dtype is None:
        raise EngineArgsError(
            f"--kv-cache-dtype: {args.kv_cache_dtype!r} is not one of {', '.join(sorted(_KV_DTYPES))}"
        )
    if args.pipeline_parallel_size > 1:
        warnings.append("--pipeline-parallel-size: not modelled; one pipeline stage assumed")
    roof = roofline(args.tensor_parallel_size, dtype, kv_dtype, not args.disable_cascade_attn)
    default_seqs, default_batched = vllm.default_limits(roof.gpu)
    max_num_seqs = args.max_num_seqs or default_seqs
    batched = args.max_num_batched_tokens
    if batched is None:
        batched = max(default_batched, max_num_seqs)
    elif batched < max_num_seqs:
        raise EngineArgsError(
            f"--max-num-batched-tokens: {batched} must be greater than or equal to --max-num-seqs {max_num_seqs}"
        )
    if args.max_num_active_seqs is not None and args.max_num_active_seqs > max_num_seqs:
        raise EngineArgsError(
            f"--max-num-active-seqs: {args.max_num_active_seqs} cannot be greater than --max-num-seqs {max_num_seqs}"
        )
    max_model_len = args.max_model_len or DEFAULT_MAX_MODEL_LEN
    if args.kv_cache_memory_bytes is not None:  # vLLM then ignores --gpu-memory-utilization
        blocks = args.num_gpu_blocks_override or blocks_for_pool(
            roof, args.kv_cache_memory_bytes, args.block_size
        )
    else:
        blocks = args.num_gpu_blocks_override or vllm_num_gpu_blocks(
            roof, args.gpu_memory_utilization, args.block_size
        )
    if blocks <= 0 and args.block_size * roof.kv_bytes_per_token > roof.gpu.memory_bytes:
        raise EngineArgsError(
            f"--block-size: one block of {args.block_size:,} tokens is larger than the GPU's memory"
        )
    if blocks <= 0:
        raise EngineArgsError(f"--gpu-memory-utilization: {no_kv_memory(roof, args.gpu_memory_utilization)}")
    pool_bytes = blocks * args.block_size * roof.kv_bytes_per_token
    if pool_bytes > roof.gpu.memory_bytes:  # the emulator holds a count per block and per block slot
        sized_by = (
            "--num-gpu-blocks-override"
            if args.num_gpu_blocks_override
            else "--kv-cache-memory-bytes"
            if args.kv_cache_memory_bytes is not None
            else "--gpu-memory-utilization"
        )
        raise EngineArgsError(
            f"{sized_by}/--block-size: {blocks:,} blocks of {args.block_size:,} tokens need "
            f"{pool_bytes / 1e9:,.0f} GB of KV cache per GPU, more than the GPU's {roof.gpu.memory_bytes / 1e9:,.0f} GB"
        )
    try:
        config = EngineConfig(
            roofline=roof,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=batched,
            max_num_active_seqs=args.max_num_active_seqs,
            num_gpu_blocks=blocks,
            block_size=args.block_size,
            max_model_len=max_model_len,
            enable_prefix_caching=args.enable_prefix_caching,
            step_noise=args.step_noise,
            max_waiting=args.max_waiting,
            **_fault(args),
        )
    except EngineConfigError as error:
        raise EngineArgsError(f"--max-model-len: {error}") from None
    cache_info = {
        "block_size": str(args.block_size),
        "cache_dtype": args.kv_cache_dtype,
        "calculate_kv_scales": "False",
        "cpu_offload_gb": "0",
        "enable_prefix_caching": str(bool(args.enable_prefix_caching)),
        "gpu_memory_utilization": str(args.gpu_memory_utilization),
        "is_attention_free": "False",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(blocks),
        "num_gpu_blocks_override": str(args.num_gpu_blocks_override),
        "prefix_caching_hash_algo": "sha256",
        "sliding_window": str(roof.model.sliding_window),
        "swap_space": "4",
    }
    return EmulatorSettings(
        **common, served_model_name=served, config=config, cache_info=cache_info, warnings=tuple(warnings)
    )


def _live_endpoints(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[bool, bool]:
    """Which runtime endpoints to serve: the switches, or the pod's env naming them."""
    named = {word.strip() for word in env.get(LIVE_ENDPOINTS_ENV, "").split(",") if word.strip()}
    unknown = sorted(named - set(LIVE_ENDPOINTS))
    if unknown:
        raise EngineArgsError(
            f"${LIVE_ENDPOINTS_ENV}: {', '.join(unknown)} is not one of {', '.join(LIVE_ENDPOINTS)} "
            "(comma-separated)"
        )
    return (
        args.emulator_runtime_config or "runtime-config" in named,
        args.emulator_trimtab or "trimtab" in named,
    )


def _fault(args: argparse.Namespace) -> dict[str, Any]:
    if args.fault_step_slowdown is None:
        return {}
    return {"fault_step_slowdown": args.fault_step_slowdown, "fault_above_running": args.fault_above_running}


def _sglang(
    args: argparse.Namespace, common: dict[str, Any], served: str, roofline: Any, warnings: list[str]
) -> EmulatorSettings:
    """SGLang's pool: --mem-fraction-static of the whole GPU memory for weights + KV, in pages of
    --page-size tokens (1: the radix tree shares a prefix token by token, held once in the pool)."""
    dtype = _DTYPES.get(args.dtype.lower())
    if dtype is None:
        raise EngineArgsError(f"--dtype: {args.dtype!r} is not one of {', '.join(sorted(_DTYPES))}")
    kv_dtype = _KV_DTYPES.get(args.kv_cache_dtype.lower())
    if kv_dtype is None:
        raise EngineArgsError(
            f"--kv-cache-dtype: {args.kv_cache_dtype!r} is not one of {', '.join(sorted(_KV_DTYPES))}"
        )
    # the radix-shared prefix counts once, in the pool and in the step's reads: the unique context
    # per sequence is what the planner sizes the batch for (the knee rises with sharing)
    roof = roofline(args.tp_size, dtype, kv_dtype, not args.disable_radix_cache)
    pages = vllm_num_gpu_blocks(roof, args.mem_fraction_static, args.page_size)
    if args.max_total_tokens is not None:
        pages = min(pages, args.max_total_tokens // args.page_size)
    if pages <= 0:
        raise EngineArgsError(f"--mem-fraction-static: {no_kv_memory(roof, args.mem_fraction_static)}")
    pool_tokens = pages * args.page_size
    context_length = args.context_length or DEFAULT_MAX_MODEL_LEN
    if pool_tokens < context_length:
        warnings.append(
            f"--context-length {context_length} exceeds the KV pool ({pool_tokens} tokens): using {pool_tokens}"
        )
        context_length = pool_tokens
    max_running = args.max_running_requests or sglang.default_max_running_requests(
        pool_tokens, context_length
    )
    try:
        config = EngineConfig(
            roofline=roof,
            max_num_seqs=max_running,
            max_num_batched_tokens=max(args.chunked_prefill_size, max_running),
            num_gpu_blocks=pages,
            block_size=args.page_size,
            max_model_len=context_length,
            enable_prefix_caching=not args.disable_radix_cache,
            step_noise=args.step_noise,
            max_waiting=args.max_waiting,
        )
    except EngineConfigError as error:
        raise EngineArgsError(f"--context-length: {error}") from None
    if not args.enable_metrics:
        warnings.append("--enable-metrics not given: SGLang would export no metrics; the emulator still does")
    cache_info = {
        "page_size": str(args.page_size),
        "max_total_num_tokens": str(pool_tokens),
        "mem_fraction_static": str(args.mem_fraction_static),
        "disable_radix_cache": str(bool(args.disable_radix_cache)),
    }
    return EmulatorSettings(
        **common, served_model_name=served, config=config, cache_info=cache_info, warnings=tuple(warnings)
    )


def read_trtllm_yaml(path: Path) -> dict[str, Any]:
    try:
        document = yaml.safe_load(path.read_text())
    except OSError as error:
        raise EngineArgsError(f"--extra_llm_api_options: cannot read {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise EngineArgsError(f"--extra_llm_api_options: {path} is not UTF-8 text (a YAML file)") from None
    except yaml.YAMLError as error:
        raise EngineArgsError(f"--extra_llm_api_options: {path} is not YAML ({error})") from None
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise EngineArgsError(f"--extra_llm_api_options: {path} must be a YAML mapping")
    return document


def _yaml_int(document: dict[str, Any], key: str, where: str) -> int | None:
    value = document.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise EngineArgsError(f"--extra_llm_api_options: {where}{key} must be a positive whole number")
    return value


def _trtllm(
    args: argparse.Namespace, common: dict[str, Any], served: str, roofline: Any, warnings: list[str]
) -> EmulatorSettings:
    document = read_trtllm_yaml(args.extra_llm_api_options) if args.extra_llm_api_options else {}
    kv = document.get("kv_cache_config") or {}
    if not isinstance(kv, dict):
        raise EngineArgsError("--extra_llm_api_options: kv_cache_config must be a mapping")
    max_batch_size = _yaml_int(document, "max_batch_size", "") or args.max_batch_size
    max_num_tokens = _yaml_int(document, "max_num_tokens", "") or args.max_num_tokens
    max_seq_len = _yaml_int(document, "max_seq_len", "") or args.max_seq_len
    tp = _yaml_int(document, "tensor_parallel_size", "") or args.tp_size
    tokens_per_block = (
        _yaml_int(kv, "tokens_per_block", "kv_cache_config.")
        or _yaml_int(document, "tokens_per_block", "")
        or trtllm_engine.DEFAULT_TOKENS_PER_BLOCK
    )
    max_tokens = _yaml_int(kv, "max_tokens", "kv_cache_config.")
    fraction = kv.get("free_gpu_memory_fraction", args.kv_cache_free_gpu_memory_fraction)
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0.0 < fraction <= 1.0:
        raise EngineArgsError(
            "--extra_llm_api_options: kv_cache_config.free_gpu_memory_fraction must be in (0, 1]"
        )
    block_reuse = kv.get("enable_block_reuse", True)
    if not isinstance(block_reuse, bool):
        raise EngineArgsError(
            "--extra_llm_api_options: kv_cache_config.enable_block_reuse must be true or false"
        )
    kv_dtype = _KV_DTYPES.get(str(kv.get("dtype", "auto")).lower())
    if kv_dtype is None:
        raise EngineArgsError("--extra_llm_api_options: kv_cache_config.dtype must be auto or fp8")
    backend = document.get("backend") or args.backend
    switched = trtllm_engine.metrics_options(str(backend) if backend else None)
    switched_off = [key for key, on in switched.items() if document.get(key) is not on]
    if switched_off:
        warnings.append(
            f"--extra_llm_api_options: {' and '.join(switched_off)} not true: trtllm-serve would export no "
            "Prometheus metrics (return_perf_metrics) or no running and KV gauges (enable_iter_perf_stats); "
            "the emulator still does"
        )
    scheduler = document.get("scheduler_config") or {}
    policy = (
        str(scheduler.get("capacity_scheduler_policy", "GUARANTEED_NO_EVICT"))
        if isinstance(scheduler, dict)
        else "GUARANTEED_NO_EVICT"
    )
    if policy not in ("GUARANTEED_NO_EVICT", "MAX_UTILIZATION", "STATIC_BATCH"):
        raise EngineArgsError(
            f"--extra_llm_api_options: scheduler_config.capacity_scheduler_policy {policy!r} is unknown"
        )
    roof = roofline(tp, "bf16", kv_dtype, False)  # no cascade attention: shared blocks re-read
    blocks = trtllm_num_blocks(roof, float(fraction), max_tokens, tokens_per_block)
    if blocks <= 0:
        raise EngineArgsError(
            f"--kv_cache_free_gpu_memory_fraction: no KV cache memory left for {roof.model.name} on {roof.gpu.name}"
        )
    pool_tokens = blocks * tokens_per_block
    seq_len = max_seq_len or DEFAULT_MAX_MODEL_LEN
    if pool_tokens < seq_len:
        warnings.append(
            f"max_seq_len {seq_len} exceeds the KV pool ({pool_tokens} tokens): using {pool_tokens}"
        )
        seq_len = pool_tokens
    max_num_tokens = max(max_num_tokens, max_batch_size)
    try:
        config = EngineConfig(
            roofline=roof,
            max_num_seqs=max_batch_size,
            max_num_batched_tokens=max_num_tokens,
            num_gpu_blocks=blocks,
            block_size=tokens_per_block,
            max_model_len=seq_len,
            enable_prefix_caching=block_reuse,
            reserve_full_sequence=policy != "MAX_UTILIZATION",
            step_noise=args.step_noise,
            max_waiting=args.max_waiting,
            **_fault(args),
        )
    except EngineConfigError as error:
        raise EngineArgsError(str(error)) from None
    trtllm = {
        "max_batch_size": max_batch_size,
        "max_num_tokens": max_num_tokens,
        "max_tokens": max_tokens,
        "free_gpu_memory_fraction": float(fraction),
        "tokens_per_block": tokens_per_block,
        "enable_block_reuse": block_reuse,
        "capacity_scheduler_policy": policy,
    }
    cache_info = {
        "tokens_per_block": str(tokens_per_block),
        "max_tokens": str(max_tokens),
        "free_gpu_memory_fraction": str(fraction),
        "enable_block_reuse": str(block_reuse),
    }
    return EmulatorSettings(
        **common,
        served_model_name=served,
        config=config,
        cache_info=cache_info,
        warnings=tuple(warnings),
        trtllm=trtllm,
    )


def help_text(engine: str = "vllm") -> str:
    return _emulator_parser(engine).format_help()
