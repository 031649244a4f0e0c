"""Adopted workloads (`spec.targetRef`): a Deployment or StatefulSet the user already runs (pure).

The operator writes exactly one value into it — the env var `BATCHKNEE_MAX_NUM_SEQS` of the engine
container, by server-side apply owning only that list entry (`env` is a list keyed by `name`, so
Helm, Argo CD or `kubectl apply` keep every other field). The user's args reference it as
`--max-num-seqs=$(BATCHKNEE_MAX_NUM_SEQS)`; Kubernetes expands `$(VAR)` in args, and the env change
rolls the pods the way the workload's own strategy says. Nothing else is read from or written to the
workload: the rollout record lives in the LLMServing's status.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from batchknee.api.models import TARGET_ENV_VAR, Engine, TargetRef
from batchknee.core.engine_args import flag_uses, int_flag
from batchknee.engines import sglang, trtllm, vllm
from batchknee.render import ENGINE_MODULES, MAX_ENGINE_WORDS, DeploymentState, as_int, rollout_state

# The flag each engine's batch limit is set with, as the user wires it in their args.
KNOB_FLAG = {
    Engine.VLLM: vllm.KNOB_FLAG,
    Engine.TensorRTLLM: trtllm.KNOB_FLAG,
    Engine.SGLang: sglang.KNOB_FLAG,
}
# What in a container's command or args says it starts the engine.
ENGINE_MARKERS = {
    Engine.VLLM: vllm.COMMANDS,
    Engine.TensorRTLLM: trtllm.COMMANDS,
    Engine.SGLang: sglang.COMMANDS,
}
REFERENCE = f"$({TARGET_ENV_VAR})"
SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh"})
SHELL_SCRIPT_FLAG = re.compile(r"-[a-z]*c[a-z]*")  # -c, -ec, -lc


def tuned_workload(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """The workload (kind, name) an LLMServing as stored adopts, or None: no `spec.targetRef`, or
    the LLMServing is being deleted (it then tunes nothing)."""
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    ref = spec.get("targetRef") if isinstance(spec, Mapping) else None
    if meta.get("deletionTimestamp") or not isinstance(ref, Mapping) or not ref.get("name"):
        return None
    return str(ref.get("kind")), str(ref.get("name"))


def tuner(body: Mapping[str, Any]) -> tuple[str, str]:
    """(creationTimestamp, name): of two LLMServings adopting one workload the first keeps it."""
    meta = body.get("metadata") or {}
    return str(meta.get("creationTimestamp") or ""), str(meta.get("name") or "")


def wiring_argument(engine: Engine) -> str:
    """The exact argument a user adds to their engine container."""
    return f"{KNOB_FLAG[engine]}={REFERENCE}"


@dataclass(frozen=True)
class Target:
    """The adopted workload as the operator sees it; `problem` (a CamelCase reason and a message)
    when it cannot be tuned, and then nothing is written."""

    kind: str
    name: str
    container: str | None
    wired: bool
    state: DeploymentState | None
    pod_labels: Mapping[str, str] | None  # the workload's own selector (matchLabels)
    resource_version: str | None
    problem: tuple[str, str] | None = None
    second_limit: str | None = None  # a second cap on the running batch in the args, as written
    image: str | None = None  # the engine container's image (the calibration is the image's)


ALREADY_TARGETED = "AlreadyTargeted"  # another LLMServing tunes it: its pods are still this one's to watch


def unobservable(target: Target) -> bool:
    """Whether the engine pods cannot be found and read (the workload or its engine container is
    missing, or its selector is more than matchLabels); one tuned by another LLMServing is read."""
    return target.problem is not None and target.problem[0] != ALREADY_TARGETED


# The longest shell script whose first command is read: shlex splits in pure Python (a 1.4 MB
# script took 3.7 s at every evaluation); an engine's start script is a few lines.
MAX_SCRIPT_CHARS = 64 * 1024


def _words(container: Mapping[str, Any]) -> tuple[list[str], int | None]:
    """The container's command and args, and where its shell's `-c` script is among them."""
    words = [str(w) for w in (*(container.get("command") or []), *(container.get("args") or []))]
    for index, word in enumerate(words[:-2]):
        if word.rsplit("/", 1)[-1] in SHELLS and SHELL_SCRIPT_FLAG.fullmatch(words[index + 1]):
            return words, index + 2
    return words, None


def engine_words(container: Mapping[str, Any], at_most: int | None = None) -> list[str]:
    """The container's command and args; a shell's `-c` script is split into its words
    (`sh -c "vllm serve M --max-num-seqs=$(BATCHKNEE_MAX_NUM_SEQS)"`: Kubernetes expands the
    reference before the shell runs). `at_most`: only the first so many words (a script is then
    read no further than they reach, so one the shell refuses later on reads as its first words)."""
    return _engine_words(container, at_most)[0]


def _engine_words(container: Mapping[str, Any], at_most: int | None = None) -> tuple[list[str], bool]:
    """engine_words, and whether its shell script (if any) was read (not too long, quotes closed)."""
    words, script = _words(container)
    if script is None or (at_most is not None and script >= at_most):
        return words[:at_most], True
    rest = None if at_most is None else at_most - script
    command = _first_command(words[script], rest)
    first = [words[script]] if command is None else command
    return [*words[:script], *first, *words[script + 1 :]][:at_most], command is not None


def script_too_long(container: Mapping[str, Any]) -> int | None:
    """The length of the container's shell script when it is too long to be read, else None."""
    words, script = _words(container)
    return len(words[script]) if script is not None and len(words[script]) > MAX_SCRIPT_CHARS else None


def _first_command(script: str, at_most: int | None = None) -> list[str] | None:
    """The words of a shell script's first command: comments dropped, nothing after `;`, `&&`,
    `|` or `&` (another command's flags are not the engine's). None: too long to read, or the
    shell would refuse it (an unclosed quote)."""
    if len(script) > MAX_SCRIPT_CHARS:
        return None
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    command: list[str] = []
    try:
        for word in lexer:
            if set(word) <= set(";&|") or len(command) == at_most:
                break
            command.append(word)
    except ValueError:  # unbalanced quotes: the shell would refuse the script too
        return None
    return command


def _starts_engine(container: Mapping[str, Any], engine: Engine) -> bool:
    # `vllm serve M`, `python3 -m vllm.entrypoints...`, `trtllm-serve M`: a workload's every
    # container is asked at every evaluation, so its script is read no further than that
    for word in engine_words(container, at_most=4):
        base = word.rsplit("/", 1)[-1]
        if base in ENGINE_MARKERS[engine]:
            return True
    return False


def second_batch_limit(words: Sequence[str], engine: Engine) -> str | None:
    """vLLM 0.34's `--max-num-active-seqs` in the engine container's words, as written: a cap on the
    running batch beside `--max-num-seqs`, so the value the operator writes either does not run
    (above it) or stops the engine from starting (below it: vLLM refuses)."""
    if engine != Engine.VLLM:
        return None
    uses = [use for flag in vllm.STRIPPED for use in flag_uses(words, flag, vllm.COMMAND_LINE)]
    return " ".join(use.as_given for use in uses) or None


def engine_container(
    containers: Sequence[Mapping[str, Any]], engine: Engine, wanted: str | None
) -> tuple[Mapping[str, Any] | None, tuple[str, str] | None]:
    names = [str(c.get("name")) for c in containers]
    if wanted is not None:
        found = next((c for c in containers if c.get("name") == wanted), None)
        if found is None:
            return None, (
                "ContainerNotFound",
                f"spec.targetRef.container {wanted!r} is not a container of the workload "
                f"(it has {', '.join(names) or 'none'})",
            )
        return found, None
    starting = [c for c in containers if _starts_engine(c, engine)]
    if len(starting) == 1:
        return starting[0], None
    if len(containers) == 1:
        return containers[0], None
    return None, (
        "ContainerAmbiguous",
        f"the workload has containers {', '.join(names)} and "
        f"{'several' if starting else 'none'} of them start{'s' if not starting else ''} {engine.value}: "
        "name the engine container in spec.targetRef.container",
    )


def env_value(container: Mapping[str, Any]) -> int | None:
    for entry in container.get("env") or []:
        if entry.get("name") == TARGET_ENV_VAR:
            return as_int(entry.get("value"))
    return None


def references(words: Sequence[str]) -> bool:
    """Whether the engine's words take their batch limit from the operator's env var."""
    return REFERENCE in " ".join(words)


def running_value(container: Mapping[str, Any], words: Sequence[str], engine: Engine) -> int | None:
    """The batch limit the engine container (its `words`) runs: the operator's env value where the
    args reference it, else the number its args give; None where neither says (the engine's
    default, or a TensorRT-LLM options file, which overrides the flag)."""
    if references(words):
        return env_value(container)
    if engine == Engine.TensorRTLLM and any(
        flag_uses(words, flag, trtllm.COMMAND_LINE) for flag in trtllm.OPTIONS_FILE_FLAGS
    ):
        return None
    return int_flag(words, KNOB_FLAG[engine], ENGINE_MODULES[engine].COMMAND_LINE)


def adopt(ref: TargetRef, engine: Engine, workload: Mapping[str, Any] | None, namespace: str) -> Target:
    """What the operator may do with the workload `ref` names."""
    if workload is None:
        return Target(
            ref.kind,
            ref.name,
            None,
            False,
            None,
            None,
            None,
            ("TargetNotFound", f"{ref.kind} {namespace}/{ref.name} (spec.targetRef) does not exist"),
        )
    spec = workload.get("spec", {})
    selector = spec.get("selector") or {}
    labels = selector.get("matchLabels") or None
    containers = (spec.get("template", {}).get("spec", {}) or {}).get("containers") or []
    version = workload.get("metadata", {}).get("resourceVersion")
    container, problem = engine_container(containers, engine, ref.container)
    if container is None:
        return Target(ref.kind, ref.name, None, False, None, labels, version, problem)
    if selector.get("matchExpressions") or not labels:
        problem = (
            "SelectorUnsupported",
            f"{ref.kind} {namespace}/{ref.name} selects its pods with matchExpressions; the operator "
            "finds the engine pods by matchLabels only",
        )
    words, readable = _engine_words(container)
    if len(words) > MAX_ENGINE_WORDS:
        return Target(
            ref.kind,
            ref.name,
            str(container.get("name")),
            False,
            rollout_state(workload, None, None, ()),
            labels,
            version,
            problem
            or (
                "ArgsTooLong",
                f"container {container.get('name')} of {ref.kind} {namespace}/{ref.name} has "
                f"{len(words):,} words of command and args; the operator reads at most "
                f"{MAX_ENGINE_WORDS:,}: start the engine with fewer",
            ),
        )
    length = script_too_long(container)
    if length is not None:
        problem = problem or (
            "ScriptTooLong",
            f"container {container.get('name')} of {ref.kind} {namespace}/{ref.name} runs a shell script of "
            f"{length:,} characters; the operator reads scripts of at most {MAX_SCRIPT_CHARS:,}: start the "
            "engine from a shorter script or from command and args",
        )
    elif not readable:  # the container was chosen by its script's first words only
        problem = problem or (
            "ScriptUnreadable",
            f"container {container.get('name')} of {ref.kind} {namespace}/{ref.name} runs a shell script "
            "the shell cannot read (an unclosed quote or a trailing backslash): fix the script",
        )
    second_limit = second_batch_limit(words, engine)
    return Target(
        ref.kind,
        ref.name,
        str(container.get("name")),
        references(words) and second_limit is None,
        rollout_state(workload, running_value(container, words, engine), None, ()),
        labels,
        version,
        problem,
        second_limit,
        str(container.get("image")) if container.get("image") else None,
    )


def env_patch(target: Target, namespace: str, value: int) -> dict[str, Any]:
    """The server-side apply body that sets the one env entry and nothing else; conditional on the
    resourceVersion the decision was made on."""
    return {
        "apiVersion": "apps/v1",
        "kind": target.kind,
        "metadata": {"name": target.name, "namespace": namespace, "resourceVersion": target.resource_version},
        "spec": {
            "template": {
                "spec": {
                    "containers": [
                        {"name": target.container, "env": [{"name": TARGET_ENV_VAR, "value": str(value)}]}
                    ]
                }
            }
        },
    }
