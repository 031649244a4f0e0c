"""The options an engine's server command line takes, read from its pinned wheel with `ast` (never
imported), to hold the flags the operator manages, strips and reads to the release.

    python tests/contract/options.py vllm     # every option `vllm serve` takes
    python tests/contract/options.py sglang   # every option `python -m sglang.launch_server` takes
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping

from extract import dataclass_fields, wheel_sources
from wheels import wheel_path

from batchknee.core.engine_args import abbreviates
from batchknee.engines.contract import CommandLine


def _added_options(tree: ast.AST) -> set[str]:
    """The literal option strings of every `add_argument(...)` call under `tree`."""
    return {
        arg.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "add_argument"
        for arg in node.args
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("-")
    }


def _definition(tree: ast.Module, name: str) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return node
    raise LookupError(f"no definition {name}")


def vllm_serve_options(sources: Mapping[str, str]) -> set[str]:
    """`vllm serve`'s parser (vllm/entrypoints/common/cli_args.py `make_arg_parser`): its own
    arguments, one `--field-name` per field of the frontend dataclasses, then every argument the
    engine's `EngineArgs`/`AsyncEngineArgs.add_cli_args` add (vllm/engine/arg_utils.py, all literal)."""
    frontend = sources["vllm/entrypoints/common/cli_args.py"]
    options = _added_options(_definition(ast.parse(frontend), "make_arg_parser"))
    for dataclass in ("BaseFrontendArgs", "FrontendArgs"):
        options |= {f"--{name.replace('_', '-')}" for name in dataclass_fields(frontend, dataclass)}
    return options | _added_options(ast.parse(sources["vllm/engine/arg_utils.py"]))


def _arg_metadata(annotation: ast.expr) -> ast.expr | None:
    """The CLI metadata of a field annotated `A[T, "help"]` or `A[T, Arg(...)]` (None: no option)."""
    if not isinstance(annotation, ast.Subscript) or not isinstance(annotation.slice, ast.Tuple):
        return None
    if ast.unparse(annotation.value) not in ("A", "Annotated", "typing.Annotated"):
        return None
    for meta in annotation.slice.elts[1:]:
        if isinstance(meta, ast.Constant) and isinstance(meta.value, str):
            return meta
        if isinstance(meta, ast.Call) and ast.unparse(meta.func) == "Arg":
            return meta
    return None


def sglang_server_options(sources: Mapping[str, str]) -> set[str]:
    """SGLang's server parser (`ServerArgs.add_cli_args`): one option per field of the namespaces in
    sglang/srt/arg_groups/fields/ that carries help or an `Arg` (its `cli_name`, else `--field-name`,
    and its `aliases`; none for `no_cli=True`), plus the arguments it registers by hand."""
    options = _added_options(_definition(ast.parse(sources["sglang/srt/server_args.py"]), "add_cli_args"))
    for path, source in sources.items():
        if not path.startswith("sglang/srt/arg_groups/fields/"):
            continue
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
                continue
            meta = _arg_metadata(node.annotation)
            if meta is None:
                continue
            keywords = {k.arg: k.value for k in meta.keywords} if isinstance(meta, ast.Call) else {}
            if "no_cli" in keywords and ast.literal_eval(keywords["no_cli"]):
                continue
            name = keywords.get("cli_name")
            options.add(ast.literal_eval(name) if name else f"--{node.target.id.replace('_', '-')}")
            if "aliases" in keywords:
                options.update(ast.literal_eval(keywords["aliases"]))
    return options


def serve_options(engine: str) -> set[str]:
    sources = wheel_sources(wheel_path(engine), engine)
    return vllm_serve_options(sources) if engine == "vllm" else sglang_server_options(sources)


def abbreviation_mismatches(options: Iterable[str], flags: Iterable[str], cli: CommandLine) -> list[str]:
    """Every prefix of `flags` on which the operator and the release's argparse disagree: argparse
    expands a long-option prefix that starts exactly one option (and `--x` for `--x=…`), the
    operator reads a prefix as the flag only by its `cli.abbreviable` list."""
    longs = sorted(o for o in options if o.startswith("--"))
    problems = []
    for flag in flags:
        for end in range(3, len(flag)):
            prefix = flag[:end]
            starting = [o for o in longs if o.startswith(prefix)]
            argparse_reads_flag = starting == [flag]
            if abbreviates(prefix, flag, cli) != argparse_reads_flag:
                problems.append(
                    f"{prefix}: argparse reads {'it as ' + flag if argparse_reads_flag else 'one of ' + str(starting)}, "
                    f"the operator {'does not' if argparse_reads_flag else 'reads ' + flag}"
                )
    return problems


if __name__ == "__main__":
    print("\n".join(sorted(serve_options(sys.argv[1] if len(sys.argv) > 1 else "vllm"))))
