"""Bad input to `plan`, `simulate`, `bench`, `emulate`, `demo` and `operator`: a one- or two-line
`batchknee <cmd>: error: …` naming the option, exit status 2 — no traceback, no hang, no figure
for a setup that cannot run, and nothing started or written first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runner import run

PLAN = ["plan", "--model", "llama-3-8b", "--gpu", "h100-sxm"]
SIMULATE = ["simulate", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--sweep", "8"]
BENCH = ["bench", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--duration", "60", "--trace", "flapping"]


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], option: str) -> str:
    status, out, err = run(capsys, *argv)
    assert status == 2, err
    assert out == ""
    assert err.startswith(f"batchknee {argv[0]}: error: ") and option in err
    assert len(err.strip().splitlines()) <= 2 and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("argv", "option", "words"),
    [
        # (was: `recommended --max-num-seqs 1 … (minimum bound)`, kvCapacityBatch 0, exit 0)
        (
            ["plan", "--model", "llama-3.1-405b", "--gpu", "l4", "--context", "512"],
            "--tp/--gpu",
            "811.8 GB of weights per GPU",
        ),
        ([*PLAN, "--context", "1000000"], "--context", "131.1 GB of KV cache"),
        (
            [*PLAN, "--context", "2048", "--tpot-target-ms", "1"],
            "--tpot-target-ms",
            "cannot be met at any batch",
        ),
        (
            [*PLAN, "--context", "2048", "--tpot-target-ms", "1", "--prompt-fraction", "0"],
            "--tpot-target-ms",
            "TPOT of 4.9 ms",
        ),
        # (was: OverflowError in recommend.round_up)
        ([*PLAN, "--params", "1e308", "--context", "512"], "argument --params", "at most"),
        ([*PLAN, "--knee-factor", "1e308"], "argument --knee-factor", "at most 2"),
        # (was: a recommendation of 32 at ×0.50, a factor no LLMServing can state)
        ([*PLAN, "--knee-factor", "0.5"], "argument --knee-factor", "at least 1 (kneeFactorPercent 100)"),
        # (was: `inf TB/s` and TPOT 0.0)
        ([*PLAN, "--bandwidth", "1e300TB/s"], "argument --bandwidth", "finite"),
        # (was: TPOT 0.0)
        ([*PLAN, "--tp", "1000000"], "--tp", "more than 64"),
        ([*PLAN, "--tp", "3"], "--tp", "does not divide llama-3-8b's 32 attention heads"),
        (
            [*PLAN, "--tpot-target-ms", "30", "--max-num-batched-tokens", "99999999999"],
            "--max-num-batched-tokens",
            "1,048,576",
        ),
        # (was: a LoadError traceback)
        ([*SIMULATE[:-1], "100000000"], "argument --sweep", "at most 65536"),
        # (was: hours of simulation)
        ([*SIMULATE, "--duration", "1e308"], "argument --duration", "a day"),
        ([*SIMULATE, "--benchmark", "--duration", "1e308"], "argument --duration", "a day"),
        # (was: rows of 0 tok/s)
        ([*SIMULATE, "--duration", "1e-9"], "--duration", "shorter than one request's decode"),
        # (was: `concurrency: … or null`, `promptSpread: …`, and --block-size blamed --gpu-memory-utilization)
        ([*SIMULATE, "--concurrency", "100000000"], "--concurrency: ", "100000"),
        ([*SIMULATE, "--prompt-spread", "5"], "--prompt-spread: ", "[0, 4]"),
        ([*SIMULATE, "--block-size", "100000000"], "--block-size: ", "larger than the"),
        # (was: a run that never ended, its refused clients back at the same instant; --max-model-len
        # blamed for a prompt the user gave)
        ([*SIMULATE, "--max-model-len", "10"], "--max-model-len: ", "not longer than --prompt-tokens 512"),
        ([*SIMULATE, "--prompt-tokens", "600000"], "--prompt-tokens/--output-tokens: ", "fewer than one"),
        # the default 8,192 does not fit, the prompt and output would: --max-model-len is the fix
        (
            [
                *SIMULATE,
                "--gpu-memory-utilization",
                "0.205",
                "--prompt-tokens",
                "100",
                "--output-tokens",
                "100",
            ],
            "--max-model-len: ",
            "8192",
        ),
        (
            [*SIMULATE, "--max-num-batched-tokens", "99999999999"],
            "argument --max-num-batched-tokens",
            "1,048,576",
        ),
        (
            ["simulate", "--model", "llama-3.1-405b", "--gpu", "l4", "--sweep", "8"],
            "--tp/--gpu",
            "no KV cache",
        ),
        # (was: a LoadError traceback; a hang)
        ([*BENCH[:5], "--duration", "1e308"], "argument --duration", "a day"),
        (
            [*BENCH, "--max-num-batched-tokens", "99999999999"],
            "argument --max-num-batched-tokens",
            "1,048,576",
        ),
        # (was: a table of zeros and `-`: no request finished and batchknee's goals saw no window)
        ([*BENCH[:5], "--duration", "1"], "--duration: 1 s", "give --duration 300 or more"),
        (
            [*BENCH[:5], "--duration", "299"],
            "--duration: 299 s",
            "a full 300 s evaluation window (--window-seconds)",
        ),
        # (was: an empty targets block; `kneeFactorPercent must be within 100–200`; an EngineConfigError)
        ([*BENCH[:-1], ""], "argument --trace", "flapping"),
        ([*BENCH, "--knee-factor-percent", "-5"], "--knee-factor-percent", "within 100–200"),
        # (was: ignored: an open loop of 100 requests/s reported for a closed loop of 4; no plot written)
        ([*SIMULATE, "--benchmark", "--duration", "5", "--concurrency", "4"], "--concurrency: ", "open loop"),
        ([*SIMULATE, "--benchmark", "--goal", "knee"], "--goal: ", "drop it"),
        # (was: ignored, the plan of no sharing)
        (
            [*PLAN, "--context", "512,2048", "--prefix-sharing", "0.5", "--output-tokens", "5000"],
            "--output-tokens: ",
            "no prompt at any context",
        ),
        ([*PLAN, "--output-tokens", "500"], "--output-tokens: ", "only with --prefix-sharing"),
        # (was: a row of 2e18-ms TPOT; `--peering` silently dropped)
        ([*PLAN, "--batch", "99999999999999999999"], "argument --batch", "65536"),
        (["crd", "--requester-policy", "--peering"], "argument --peering", "not allowed with"),
        # (was: plan refused 0, which spec.tuning takes; plan and simulate took 99.9, which it refuses)
        (
            [*PLAN, "--goal", "slo", "--tpot-target-ms", "30", "--slo-margin-percent", "95"],
            "--slo-margin-percent",
            "90",
        ),
        (
            [*SIMULATE, "--goal", "slo", "--tpot-target-ms", "30", "--slo-margin-percent", "99.9"],
            "--slo-margin-percent",
            "90",
        ),
        # (was: exit 1, without the command's name)
        (["dev-cluster", "up", "--runtime", "bad"], "--runtime: ", "NAME=COMMAND"),
        (["dev-cluster", "exec"], "exec: ", "give a command after --"),
        # (was: accepted, an operator no LLMServing could describe)
        ([*BENCH, "--window-seconds", "0"], "--window-seconds", "within 30–3,600"),
        ([*BENCH, "--cooldown-seconds", "1" + "0" * 25], "--cooldown-seconds", "within 0–86,400"),
        ([*BENCH, "--tpot-target-ms", "1" + "0" * 22], "--tpot-target-ms", "within 1–100,000"),
        ([*BENCH, "--restart-seconds", "1e300"], "argument --restart-seconds", "a day"),
        (
            ["bench", "--model", "llama-3.1-405b", "--gpu", "l4", "--trace", "flapping"],
            "--tp/--gpu",
            "no KV cache",
        ),
    ],
)
def test_bad_input_is_refused_naming_the_option(
    capsys: pytest.CaptureFixture[str], argv: list[str], option: str, words: str
) -> None:
    err = _refused(capsys, argv, option)
    assert words in err and "null" not in err


@pytest.mark.parametrize("command", [PLAN, SIMULATE, BENCH])
def test_an_unwritable_plot_is_refused_before_any_work(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, command: list[str]
) -> None:
    def simulated(*_: object, **__: object) -> None:
        raise AssertionError("the work ran before the output path was checked")

    monkeypatch.setattr("batchknee.commands.bench.bench_trace", simulated)
    monkeypatch.setattr("batchknee.commands.simulate.sweep", simulated)
    monkeypatch.setattr("batchknee.commands.plan.build_plan", simulated)
    _refused(capsys, [*command, "--plot", str(tmp_path / "missing" / "x.png")], "--plot: folder")
    if command is BENCH:
        _refused(capsys, [*command, "--json-file", str(tmp_path / "missing" / "out.json")], "--json-file")


def test_a_file_that_is_not_utf8_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00bad")
    _refused(capsys, ["plan", "--model-config", str(binary), "--gpu", "h100-sxm"], "--model-config")
    _refused(
        capsys,
        ["emulate", "trtllm", "serve", "meta-llama/Meta-Llama-3-8B", "--extra_llm_api_options", str(binary)],
        "--extra_llm_api_options",
    )


def _nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    def started(*_: object, **__: object) -> None:
        raise AssertionError("the demo started before checking its input")

    monkeypatch.setattr("batchknee.devcluster.netns.exec_inside", started)
    monkeypatch.setattr("batchknee.demo.world.DemoWorld.__init__", started)


def test_demo_checks_the_gpu_and_the_binaries_before_starting(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _nothing_starts(monkeypatch)
    out = tmp_path / "demo-out"
    _refused(capsys, ["demo", "--gpu", "nope", "--out", str(out)], "--gpu: unknown GPU 'nope'")
    monkeypatch.setenv("BATCHKNEE_TOOLS_BIN", str(tmp_path))  # no control-plane binaries there
    _refused(capsys, ["demo", "--out", str(out)], "make tools")
    assert not out.exists()
    # (was: a FileExistsError traceback once the cluster had started)
    taken = tmp_path / "a-file"
    taken.write_text("")
    _refused(capsys, ["demo", "--out", str(taken)], "--out: ")
    _refused(capsys, ["demo", "--out", str(tmp_path / "no" / "such")], "--out: folder")


def test_operator_without_a_cluster_configuration(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env["KUBECONFIG"] = str(tmp_path / "nonexistent")
    done = subprocess.run(
        [sys.executable, "-m", "batchknee", "operator"], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("batchknee operator: error: no cluster configuration found")
    assert "KUBECONFIG" in done.stderr and "Traceback" not in done.stderr


def test_a_closed_pipe_ends_the_output_quietly() -> None:
    contexts = ",".join(str(c) for c in range(100, 20001, 100))  # more than a pipe buffer
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchknee", *PLAN, "--context", contexts],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # `| head -1` that has read its line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141
    assert err == ""
