"""The emulate command line: a pod's own vLLM / trtllm-serve args, unchanged (the kubelet contract)."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchknee.core import DecodeRoofline, find_gpu, find_model
from batchknee.emulator.engine_args import EngineArgsError, parse_emulator_args

KUBELET_LINE = [
    "--engine",
    "vllm",
    "--gpu",
    "a100-80gb",
    "serve",
    "meta-llama/Meta-Llama-3-8B",
    "--max-num-seqs",
    "64",
    "--served-model-name",
    "llama",
    "--port",
    "8000",
    "--host",
    "127.1.0.3",
]


def test_the_kubelet_line() -> None:
    settings = parse_emulator_args(KUBELET_LINE, environ={})
    config = settings.config
    assert (settings.engine, settings.model, settings.served_model_name) == ("vllm", "llama-3-8b", "llama")
    assert (settings.host, settings.port, settings.gpu) == ("127.1.0.3", 8000, "a100-80gb")
    assert config.max_num_seqs == 64
    assert config.max_num_batched_tokens == 2048  # vLLM's default on an A100
    assert config.block_size == 16 and config.enable_prefix_caching
    roofline = DecodeRoofline(find_model("llama-3-8b"), find_gpu("a100-80gb"))
    expected_blocks = int(roofline.kv_pool_bytes(0.9) // (16 * 131_072))
    assert config.num_gpu_blocks == expected_blocks
    assert settings.cache_info["num_gpu_blocks"] == str(expected_blocks)
    assert settings.ignored == ()


def test_engine_flags_in_every_spelling_and_unknown_flags_ignored() -> None:
    settings = parse_emulator_args(
        [
            "--engine=vllm",
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            "meta-llama/Llama-3.1-70B-Instruct",
            "-tp",
            "4",
            "--max_num_seqs=96",
            "--max-num-batched-tokens",
            "4096",
            "--gpu-memory-utilization",
            "0.92",
            "--kv-cache-dtype",
            "fp8",
            "--no-enable-prefix-caching",
            "--disable-cascade-attn",
            "--max-model-len",
            "16K",
            "--trust-remote-code",
            "--swap-space",
            "8",
            "--disable-log-requests",
            "-O3",
            "--tokenizer-mode=auto",
        ],
        environ={"BATCHKNEE_EMULATOR_GPU": "h100-sxm"},
    )
    config = settings.config
    assert settings.gpu == "h100-sxm" and settings.model == "llama-3-70b"
    assert settings.served_model_name == "meta-llama/Llama-3.1-70B-Instruct"
    assert config.roofline.tensor_parallel == 4 and config.roofline.kv_dtype == "fp8"
    assert not config.roofline.shared_prefix_read_once  # --disable-cascade-attn
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (96, 4096)
    assert config.max_model_len == 16 * 1024 and not config.enable_prefix_caching  # K = 1024, k = 1000
    assert settings.cache_info["gpu_memory_utilization"] == "0.92"
    assert settings.ignored == (
        "--trust-remote-code",
        "--swap-space 8",
        "--disable-log-requests",
        "-O3",
        "--tokenizer-mode=auto",
    )


def test_vllms_kv_pool_in_bytes_and_token_budget_in_its_human_readable_forms() -> None:
    settings = parse_emulator_args(
        ["llama-3-8b", "--kv-cache-memory-bytes", "10G", "--max-num-batched-tokens", "4k"], environ={}
    )
    assert settings.config.num_gpu_blocks == 10 * 2**30 // (16 * 131_072)  # 128 KiB of KV per token
    assert settings.config.max_num_batched_tokens == 4000


def test_defaults_follow_vllm_per_gpu() -> None:
    big = parse_emulator_args(["--gpu", "h100-sxm", "llama-3-8b"], environ={}).config
    small = parse_emulator_args(["--gpu", "l40s", "llama-3-8b"], environ={}).config
    assert (big.max_num_seqs, big.max_num_batched_tokens) == (1024, 8192)
    assert (small.max_num_seqs, small.max_num_batched_tokens) == (256, 2048)


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["serve"], "model"),
        (["no-such-model"], "model"),
        (["llama-3-8b", "--gpu", "tpu"], "--gpu"),
        (["llama-3-8b", "--max-num-seqs", "0"], "--max-num-seqs"),
        (
            ["llama-3-8b", "--max-num-seqs", "512", "--max-num-batched-tokens", "256"],
            "--max-num-batched-tokens",
        ),
        (["llama-3-8b", "--speedup", "-1"], "--speedup"),
        (["llama-3-8b", "--engine", "tgi"], "--engine"),
        (["llama-3-8b", "--kv-cache-dtype", "int2"], "--kv-cache-dtype"),
        (["llama-3-70b", "--gpu", "l4"], "--gpu-memory-utilization"),
        (["llama-3-8b", "--request-rate", "1e9"], "--request-rate"),
        # (was: `load: promptTokens: …`, not the flag)
        (["llama-3-8b", "--prompt-tokens", "2000000"], "^--prompt-tokens: "),
        # (was: accepted; the engine then allocated tens of GB for its per-block counts)
        (["llama-3-8b", "--num-gpu-blocks-override", "1", "--block-size", "10000000000"], "--block-size"),
        (
            ["llama-3-8b", "--num-gpu-blocks-override", "1000000000", "--block-size", "1"],
            "--num-gpu-blocks-override",
        ),
        (["llama-3-8b", "--block-size", "10000000000"], "--block-size: one block"),
        (["llama-3-8b", "--kv-cache-memory-bytes", "200G"], "^--kv-cache-memory-bytes/"),
    ],
)
def test_errors_name_the_option(argv: list[str], names: str) -> None:
    with pytest.raises(EngineArgsError, match=names):
        parse_emulator_args(argv, environ={})


def test_trtllm_yaml_max_tokens_wins_when_smaller(tmp_path: Path) -> None:
    options = tmp_path / "extra.yaml"
    options.write_text(
        "max_batch_size: 48\n"
        "kv_cache_config:\n  max_tokens: 65536\n  free_gpu_memory_fraction: 0.9\n  enable_block_reuse: false\n"
    )
    settings = parse_emulator_args(
        [
            "--engine",
            "trtllm",
            "--gpu",
            "a100-80gb",
            "serve",
            "meta-llama/Meta-Llama-3-8B",
            "--max_batch_size",
            "256",
            "--extra_llm_api_options",
            str(options),
            "--backend",
            "pytorch",
            "--log_level",
            "info",
        ],
        environ={},
    )
    config = settings.config
    assert config.max_num_seqs == 48  # the YAML overrides the flag
    assert (config.block_size, config.num_gpu_blocks) == (32, 65536 // 32)
    assert config.reserve_full_sequence and not config.enable_prefix_caching
    assert settings.trtllm["max_tokens"] == 65536
    # trtllm-serve serves its Prometheus metrics only with these two switched on (the operator sets both)
    assert [w for w in settings.warnings if "trtllm-serve would export no" in w] == [
        "--extra_llm_api_options: return_perf_metrics and enable_iter_perf_stats not true: trtllm-serve would "
        "export no Prometheus metrics (return_perf_metrics) or no running and KV gauges (enable_iter_perf_stats); "
        "the emulator still does"
    ]
    options.write_text("return_perf_metrics: true\nenable_iter_perf_stats: true\n")
    switched_on = parse_emulator_args(
        ["--engine", "trtllm", "llama-3-8b", "--config", str(options)], environ={}
    )
    assert not [w for w in switched_on.warnings if "trtllm-serve would export no" in w]
    # Without max_tokens the fraction of the memory left after weights is the budget.
    options.write_text("kv_cache_config:\n  free_gpu_memory_fraction: 0.5\n")
    fraction_only = parse_emulator_args(
        ["--engine", "trtllm", "--gpu", "a100-80gb", "llama-3-8b", "--config", str(options)], environ={}
    )
    roofline = DecodeRoofline(find_model("llama-3-8b"), find_gpu("a100-80gb"))
    assert fraction_only.config.num_gpu_blocks == int(
        roofline.kv_pool_bytes_free_fraction(0.5) // (32 * 131_072)
    )
    assert fraction_only.config.num_gpu_blocks > 65536 // 32
    options.write_text("kv_cache_config: [1, 2]\n")
    with pytest.raises(EngineArgsError, match="kv_cache_config"):
        parse_emulator_args(["--engine", "trtllm", "llama-3-8b", "--config", str(options)], environ={})


def test_cli_emulate_help_and_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from batchknee.cli import main

    with pytest.raises(SystemExit) as help_exit:
        main(["emulate", "--engine", "trtllm", "--help"])
    assert help_exit.value.code == 0
    assert "--extra-llm-api-options" in capsys.readouterr().out
    status = main(["emulate", "serve", "llama-3-8b", "--max-num-seqs", "lots"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and "--max-num-seqs" in err and err.startswith("batchknee emulate: error:")


def test_module_entry_point_takes_the_engine_as_first_word(capsys: pytest.CaptureFixture[str]) -> None:
    # The test kubelet's runtime prefix form: python -m batchknee.emulator vllm <command[1:]> <args>.
    from batchknee.emulator.__main__ import main as module_main

    assert module_main(["trtllm", "serve", "llama-3-8b", "--max_batch_size", "0"]) == 2
    err = capsys.readouterr().err
    assert "--max-batch-size" in err and err.count("\n") == 1


def test_sglang_command_lines_both_forms() -> None:
    launch = parse_emulator_args(
        ["-m", "sglang.launch_server", "--model", "llama-3-8b", "--tp", "2", "--tensor-parallel-size", "2",
         "--max-running-requests", "96", "--mem-fraction-static", "0.8", "--context-length", "4096",
         "--enable-metrics", "--trust-remote-code", "--gpu", "h100"],
        environ={},
    )  # fmt: skip
    assert launch.engine == "sglang" and launch.model == "llama-3-8b"
    config = launch.config
    assert (config.max_num_seqs, config.roofline.tensor_parallel, config.block_size) == (96, 2, 1)
    assert config.max_model_len == 4096 and config.enable_prefix_caching
    serve = parse_emulator_args(
        ["--engine", "sglang", "serve", "--model-path", "llama-3-8b", "--disable-radix-cache"], environ={}
    )
    assert serve.model == "llama-3-8b" and not serve.config.enable_prefix_caching
    # no --max-running-requests: SGLang's own default, derived from the pool
    assert serve.config.max_num_seqs == 4096
