"""Every Prometheus metric an engine registers, read from its wheel's source with `ast` — never imported.

An engine registers a metric by calling a prometheus_client class (`Gauge(name=..., labelnames=...)`),
directly or through a name bound to one: an import alias (`from prometheus_client import Counter as
_PromCounter`), a local (`Counter = self._counter_cls or _PromCounter`), or a class attribute
(`_gauge_cls = Gauge`, overridden by Ray wrappers of the same names). Names and label lists are
evaluated from what the source spells out: string constants, f-strings, `+`, list and tuple displays,
`*` splices, locals, module constants, `self.x` attributes set in the same class, loop and
comprehension targets over literal lists, and `dict.keys()`. Several assignments to one local (an
if/else) give several candidates, and each becomes a registration.

A label list built at run time (`labels.keys()` of a parameter) is kept as a `Dynamic` marker with the
parameter's name, so `("<labels>", "phase")` reads "the caller's labels plus `phase`". A parameter can
be bound to a value the engine computes elsewhere (`param_bindings`): vLLM's metric helper classes
take `labelnames` from the stat logger that builds them.

The result names families the way the exposition's `# TYPE` line does: a counter registered as
`x_total` is the family `x` (prometheus_client strips the suffix and writes the samples as `x_total`).
"""

from __future__ import annotations

import ast
import functools
import itertools
import re
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

PROM_TYPES = {
    "Counter": "counter",
    "Gauge": "gauge",
    "Histogram": "histogram",
    "Summary": "summary",
    "Info": "info",
    "Enum": "stateset",
}
_CANDIDATE = re.compile(r"prometheus_client|_(gauge|counter|histogram|summary)_cls\b")
_MAX_CANDIDATES = 64  # a product of alternatives past this is not a name the source spells out
_MAX_DEPTH = 24


class Unresolved(Exception):
    """An expression the evaluator cannot read statically."""


@dataclass(frozen=True)
class PromType:
    kind: str  # counter | gauge | histogram | summary | info | stateset


@dataclass(frozen=True)
class _Module:
    """`import prometheus_client` (attributes of it are the metric classes)."""


@dataclass(frozen=True)
class Dynamic:
    """A value known only at run time: a parameter of the registering function."""

    origin: str

    def __str__(self) -> str:
        return f"<{self.origin}>"


@dataclass(frozen=True)
class Metric:
    name: str  # the family name, as in `# TYPE <name> <type>`
    type: str
    labels: tuple[str, ...]  # Dynamic parts are written `<param>`
    source: str  # path:line of the registration

    @property
    def static_labels(self) -> frozenset[str]:
        return frozenset(label for label in self.labels if not label.startswith("<"))

    @property
    def dynamic(self) -> bool:
        return any(label.startswith("<") for label in self.labels)


@dataclass
class Contract:
    """Every registration found, by family name; `unresolved` lists the calls that could not be read."""

    metrics: dict[str, list[Metric]] = field(default_factory=dict)
    unresolved: list[str] = field(default_factory=list)

    def add(self, metric: Metric) -> None:
        variants = self.metrics.setdefault(metric.name, [])
        if all((m.type, m.labels) != (metric.type, metric.labels) for m in variants):
            variants.append(metric)

    def types(self, name: str) -> set[str]:
        return {m.type for m in self.metrics.get(name, [])}


def field_names(source: str) -> set[str]:
    """The annotated names a module's classes declare (SGLang's flags are dataclass fields,
    dash-spelled on the command line)."""
    return {
        node.target.id
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }


def family_name(name: str, kind: str) -> str:
    return name[: -len("_total")] if kind == "counter" and name.endswith("_total") else name


# --- scopes -------------------------------------------------------------------------------------


@dataclass
class _Scope:
    module: _ModuleInfo
    cls: ast.ClassDef | None
    functions: list[ast.FunctionDef | ast.AsyncFunctionDef]  # innermost last
    loop_targets: list[tuple[ast.expr, ast.expr]]  # (target, iterable), innermost last


class _ModuleInfo:
    def __init__(self, path: str, tree: ast.Module, package: _Package) -> None:
        self.path = path
        self.tree = tree
        self.package = package
        self.assigns: dict[str, list[ast.expr]] = {}
        self.prom_names: dict[str, PromType | _Module] = {}
        self.scopes: dict[int, _Scope] | None = None  # node id → scope, built on first use
        for statement in tree.body:
            self._bind(statement, self.assigns)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "prometheus_client":
                for alias in node.names:
                    if alias.name in PROM_TYPES:
                        self.prom_names[alias.asname or alias.name] = PromType(PROM_TYPES[alias.name])
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "prometheus_client":
                        self.prom_names[alias.asname or alias.name] = _Module()

    @staticmethod
    def _bind(node: ast.AST, into: dict[str, list[ast.expr]]) -> None:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    into.setdefault(target.id, []).append(node.value)
        elif isinstance(node, ast.AnnAssign) and node.value is not None and isinstance(node.target, ast.Name):
            into.setdefault(node.target.id, []).append(node.value)


class _Package:
    def __init__(self, sources: dict[str, str]) -> None:
        self.modules: dict[str, _ModuleInfo] = {}
        for path, text in sources.items():
            try:
                tree = ast.parse(text, filename=path)
            except SyntaxError:
                continue
            self.modules[path] = _ModuleInfo(path, tree, self)
        # Class attributes that hold a metric class (`_gauge_cls = Gauge`), over the whole package:
        # subclasses in other modules call `self._gauge_cls(...)` they inherit.
        self.class_attrs: dict[str, list[tuple[_ModuleInfo, ast.expr]]] = {}
        for module in self.modules.values():
            for node in ast.walk(module.tree):
                if isinstance(node, ast.ClassDef):
                    for stmt in node.body:
                        if isinstance(stmt, ast.Assign):
                            for target in stmt.targets:
                                if isinstance(target, ast.Name) and target.id.endswith("_cls"):
                                    self.class_attrs.setdefault(target.id, []).append((module, stmt.value))
        self.classes: dict[str, list[tuple[_ModuleInfo, ast.ClassDef]]] = {}
        for module in self.modules.values():
            for node in ast.walk(module.tree):
                if isinstance(node, ast.ClassDef):
                    self.classes.setdefault(node.name, []).append((module, node))

    def lineage(self, module: _ModuleInfo, cls: ast.ClassDef) -> Iterator[tuple[_ModuleInfo, ast.ClassDef]]:
        """The class, then its bases found in the package by name (breadth first)."""
        seen: set[int] = set()
        queue = [(module, cls)]
        while queue:
            module, cls = queue.pop(0)
            if id(cls) in seen:
                continue
            seen.add(id(cls))
            yield module, cls
            for base in cls.bases:
                name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
                queue.extend(self.classes.get(name or "", []))


@functools.cache
def _function_assigns(function: ast.AST) -> dict[str, list[ast.expr]]:
    assigns: dict[str, list[ast.expr]] = {}
    for node in ast.walk(function):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and node is not function:
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            _ModuleInfo._bind(node, assigns)
    return assigns


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    args = function.args
    return {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]} | {
        a.arg for a in (args.vararg, args.kwarg) if a is not None
    }


def _self_assigns(cls: ast.ClassDef, attr: str) -> list[ast.expr]:
    return _class_attributes(cls).get(attr, [])


@functools.cache
def _class_attributes(cls: ast.ClassDef) -> dict[str, list[ast.expr]]:
    """`self.x = value` in any method and `x = value` in the class body, by attribute name."""
    found: dict[str, list[ast.expr]] = {}
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    found.setdefault(target.attr, []).append(node.value)
    for stmt in cls.body:
        if isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    found.setdefault(target.id, []).append(stmt.value)
    return found


# --- the evaluator ------------------------------------------------------------------------------


class _Evaluator:
    def __init__(self, package: _Package, param_bindings: dict[str, tuple[str, str, str]]) -> None:
        self.package = package
        self.param_bindings = param_bindings

    def eval(self, expr: ast.expr, scope: _Scope, depth: int = 0) -> list[object]:
        if depth > _MAX_DEPTH:
            raise Unresolved("too deep")
        values = self._eval(expr, scope, depth + 1)
        if len(values) > _MAX_CANDIDATES:
            raise Unresolved("too many candidates")
        return values

    def _eval(self, expr: ast.expr, scope: _Scope, depth: int) -> list[object]:
        if isinstance(expr, ast.Constant):
            return [expr.value]
        if isinstance(expr, ast.JoinedStr):
            parts = [
                self.eval(v.value, scope, depth) if isinstance(v, ast.FormattedValue) else [v.value]
                for v in expr.values
                if isinstance(v, (ast.FormattedValue, ast.Constant))
            ]
            return ["".join(_text(p) for p in combo) for combo in itertools.product(*parts)]
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
            out = []
            for left, right in itertools.product(
                self.eval(expr.left, scope, depth), self.eval(expr.right, scope, depth)
            ):
                out.append(_add(left, right))
            return out
        if isinstance(expr, (ast.List, ast.Tuple, ast.Set)):
            pieces: list[list[list[object]]] = []
            for element in expr.elts:
                if isinstance(element, ast.Starred):
                    pieces.append([_as_list(v) for v in self.eval(element.value, scope, depth)])
                else:
                    pieces.append([[v] for v in self.eval(element, scope, depth)])
            return [list(itertools.chain.from_iterable(combo)) for combo in itertools.product(*pieces)]
        if isinstance(expr, ast.Dict):
            dicts: list[dict[object, object]] = [{}]
            for key, value in zip(expr.keys, expr.values, strict=True):
                if key is None:  # {**other}
                    merged = []
                    for base, extra in itertools.product(dicts, self.eval(value, scope, depth)):
                        merged.append(_merge(base, extra))
                    dicts = merged
                else:
                    dicts = [
                        {**base, k: v}
                        for base, k, v in itertools.product(
                            dicts, self.eval(key, scope, depth), self.eval(value, scope, depth)
                        )
                    ]
            return list(dicts)
        if isinstance(expr, ast.BoolOp) and isinstance(expr.op, ast.Or):
            out = []
            for operand in expr.values:
                try:
                    out.extend(v for v in self.eval(operand, scope, depth) if v is not None)
                except Unresolved:
                    continue
            if not out:
                raise Unresolved(ast.unparse(expr))
            return out
        if isinstance(expr, ast.Name):
            return self._name(expr.id, scope, depth)
        if isinstance(expr, ast.Attribute):
            return self._attribute(expr, scope, depth)
        if isinstance(expr, ast.Subscript):
            # `metric_types[Gauge]`: a mapping from prometheus_client classes to their stand-ins
            return [v for v in self.eval(expr.slice, scope, depth) if isinstance(v, PromType)] or _raise(expr)
        if isinstance(expr, ast.Call):
            return self._call(expr, scope, depth)
        raise Unresolved(ast.unparse(expr))

    def _call(self, expr: ast.Call, scope: _Scope, depth: int) -> list[object]:
        func = expr.func
        if isinstance(func, ast.Name) and func.id in ("list", "tuple", "sorted") and len(expr.args) == 1:
            return [_as_list(v) for v in self.eval(expr.args[0], scope, depth)]
        if isinstance(func, ast.Attribute) and func.attr == "keys" and not expr.args:
            out: list[object] = []
            for value in self.eval(func.value, scope, depth):
                if isinstance(value, dict):
                    out.append(list(value))
                elif isinstance(value, Dynamic):
                    out.append([value])
                else:
                    raise Unresolved(ast.unparse(expr))
            return out
        if isinstance(func, ast.Attribute):
            # a method of a run-time value (`config_obj.metrics_info()`) is a run-time value too
            bases = self.eval(func.value, scope, depth)
            if bases and all(isinstance(b, Dynamic) for b in bases):
                return [Dynamic(f"{b.origin}.{func.attr}()") for b in bases if isinstance(b, Dynamic)]
        raise Unresolved(ast.unparse(expr))

    def _name(self, name: str, scope: _Scope, depth: int) -> list[object]:
        # loop and comprehension targets, innermost first
        for target, iterable in reversed(scope.loop_targets):
            path = _target_path(target, name)
            if path is None:
                continue
            outer = _Scope(
                scope.module,
                scope.cls,
                scope.functions,
                scope.loop_targets[: scope.loop_targets.index((target, iterable))],
            )
            out = []
            for sequence in self.eval(iterable, outer, depth):
                for item in _as_list(sequence):
                    out.append(_pick(item, path))
            return out
        for index in range(len(scope.functions) - 1, -1, -1):
            function = scope.functions[index]
            inner = _Scope(scope.module, scope.cls, scope.functions[: index + 1], [])
            assigns = _function_assigns(function).get(name)
            if assigns:
                return [v for a in assigns for v in self.eval(a, inner, depth)]
            local_imports = _local_prom_imports(function)
            if name in local_imports:
                return [local_imports[name]]
            if name in _parameters(function):
                if name in self.param_bindings:
                    return self._bound(name, depth)
                return [Dynamic(name)]
        if name in scope.module.prom_names:
            return [scope.module.prom_names[name]]
        if name in scope.module.assigns:
            top = _Scope(scope.module, None, [], [])
            return [v for a in scope.module.assigns[name] for v in self.eval(a, top, depth)]
        raise Unresolved(name)

    def _bound(self, name: str, depth: int) -> list[object]:
        path, qualname, variable = self.param_bindings[name]
        module = self.package.modules[path]
        scope = _scope_of(module, qualname)
        assigns = _function_assigns(scope.functions[-1]).get(variable)
        if not assigns:
            raise Unresolved(f"{path}:{qualname} has no local {variable}")
        return [v for a in assigns for v in self.eval(a, scope, depth)]

    def _attribute(self, expr: ast.Attribute, scope: _Scope, depth: int) -> list[object]:
        if isinstance(expr.value, ast.Name) and expr.value.id in ("self", "cls"):
            if expr.attr.endswith("_cls"):
                return self._metric_class_attr(expr.attr, scope, depth)
            if scope.cls is not None:
                for module, cls in self.package.lineage(scope.module, scope.cls):
                    assigns = _self_assigns(cls, expr.attr)
                    if assigns:
                        out = []
                        for a in assigns:
                            where = _enclosing_scope(module, a)
                            if where is None:
                                raise Unresolved(ast.unparse(expr))
                            out.extend(self.eval(a, where, depth))
                        return out
            raise Unresolved(ast.unparse(expr))
        base = self.eval(expr.value, scope, depth)
        if any(isinstance(b, _Module) for b in base) and expr.attr in PROM_TYPES:
            return [PromType(PROM_TYPES[expr.attr])]
        if base and all(isinstance(b, Dynamic) for b in base):
            return [Dynamic(f"{b.origin}.{expr.attr}") for b in base if isinstance(b, Dynamic)]
        raise Unresolved(ast.unparse(expr))

    def _metric_class_attr(self, attr: str, scope: _Scope, depth: int) -> list[object]:
        out: list[object] = []
        for module, value in self.package.class_attrs.get(attr, []):
            try:
                out.extend(
                    v
                    for v in self.eval(value, _Scope(module, None, [], []), depth)
                    if isinstance(v, PromType)
                )
            except Unresolved:
                continue  # a Ray wrapper or None: not a prometheus_client class
        if not out:
            raise Unresolved(attr)
        return out


def _raise(expr: ast.expr) -> list[object]:
    raise Unresolved(ast.unparse(expr))


def _text(value: object) -> str:
    if isinstance(value, Dynamic):
        raise Unresolved(str(value))
    return str(value)


def _add(left: object, right: object) -> object:
    if isinstance(left, str) and isinstance(right, str):
        return left + right
    if isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
        return [*left, *right]
    raise Unresolved(f"{left!r} + {right!r}")


def _merge(base: dict[object, object], extra: object) -> dict[object, object]:
    if isinstance(extra, dict):
        return {**base, **extra}
    if isinstance(extra, Dynamic):
        return {**base, extra: extra}
    raise Unresolved(repr(extra))


def _as_list(value: object) -> list[object]:
    if isinstance(value, (list, tuple, set)):
        return list(value)
    if isinstance(value, dict):
        return list(value)
    if isinstance(value, Dynamic):
        return [value]
    raise Unresolved(repr(value))


def _target_path(target: ast.expr, name: str) -> tuple[int, ...] | None:
    if isinstance(target, ast.Name):
        return () if target.id == name else None
    if isinstance(target, (ast.Tuple, ast.List)):
        for index, element in enumerate(target.elts):
            sub = _target_path(element, name)
            if sub is not None:
                return (index, *sub)
    return None


def _pick(item: object, path: tuple[int, ...]) -> object:
    for index in path:
        if not isinstance(item, (list, tuple)):
            raise Unresolved(repr(item))
        item = item[index]
    return item


@functools.cache
def _local_prom_imports(function: ast.AST) -> dict[str, PromType | _Module]:
    found: dict[str, PromType | _Module] = {}
    for node in ast.walk(function):
        if isinstance(node, ast.ImportFrom) and node.module == "prometheus_client":
            for alias in node.names:
                if alias.name in PROM_TYPES:
                    found[alias.asname or alias.name] = PromType(PROM_TYPES[alias.name])
    return found


def _scope_of(module: _ModuleInfo, qualname: str) -> _Scope:
    node: ast.AST = module.tree
    cls = None
    functions: list[ast.FunctionDef | ast.AsyncFunctionDef] = []
    for part in qualname.split("."):
        for child in ast.iter_child_nodes(node):
            if (
                isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and child.name == part
            ):
                node = child
                break
        else:
            raise Unresolved(f"{module.path} has no {qualname}")
        if isinstance(node, ast.ClassDef):
            cls = node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions.append(node)
    return _Scope(module, cls, functions, [])


def _enclosing_scope(module: _ModuleInfo, target: ast.AST) -> _Scope | None:
    if module.scopes is None:
        module.scopes = {id(node): scope for scope, node in _walk_scoped(module)}
    return module.scopes.get(id(target))


def _walk_scoped(module: _ModuleInfo) -> Iterator[tuple[_Scope, ast.AST]]:
    """Every node with its scope: enclosing class, functions, and loop/comprehension targets."""

    def visit(node: ast.AST, scope: _Scope) -> Iterator[tuple[_Scope, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            yield scope, child
            if isinstance(child, ast.ClassDef):
                yield from visit(child, _Scope(module, child, scope.functions, []))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from visit(child, _Scope(module, scope.cls, [*scope.functions, child], []))
            elif isinstance(child, (ast.For, ast.AsyncFor)):
                inner = _Scope(
                    module, scope.cls, scope.functions, [*scope.loop_targets, (child.target, child.iter)]
                )
                for stmt in child.body:
                    yield inner, stmt
                    yield from visit(stmt, inner)
                for stmt in child.orelse:
                    yield scope, stmt
                    yield from visit(stmt, scope)
            elif isinstance(child, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
                targets = [*scope.loop_targets, *((g.target, g.iter) for g in child.generators)]
                inner = _Scope(module, scope.cls, scope.functions, targets)
                parts = [child.key, child.value] if isinstance(child, ast.DictComp) else [child.elt]
                for part in parts:
                    yield inner, part
                    yield from visit(part, inner)
            else:
                yield from visit(child, scope)

    yield from visit(module.tree, _Scope(module, None, [], []))


# --- registrations ------------------------------------------------------------------------------


def _argument(call: ast.Call, keyword: str, position: int) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == keyword:
            return kw.value
    return call.args[position] if len(call.args) > position else None


def _labels(values: object) -> tuple[str, ...]:
    return tuple(str(v) for v in _as_list(values))


def extract(
    sources: dict[str, str], *, param_bindings: dict[str, tuple[str, str, str]] | None = None
) -> Contract:
    """The metric contract of the package whose files are `sources` (path → text)."""
    package = _Package(
        {p: t for p, t in sources.items() if _CANDIDATE.search(t)} | _bound_files(sources, param_bindings)
    )
    evaluator = _Evaluator(package, param_bindings or {})
    contract = Contract()
    for module in package.modules.values():
        for scope, node in _walk_scoped(module):
            if not isinstance(node, ast.Call):
                continue
            try:
                kinds = {v.kind for v in evaluator.eval(node.func, scope) if isinstance(v, PromType)}
            except Unresolved:
                continue  # not a metric class (collections.Counter, a Ray wrapper's own call, ...)
            if not kinds:
                continue
            where = f"{module.path}:{node.lineno}"
            name_expr = _argument(node, "name", 0)
            labels_expr = _argument(node, "labelnames", 2)
            try:
                names = evaluator.eval(name_expr, scope) if name_expr is not None else _raise(node)
                label_sets = (
                    [_labels(v) for v in evaluator.eval(labels_expr, scope)]
                    if labels_expr is not None
                    else [()]
                )
                prefix = "".join(
                    f"{evaluator.eval(e, scope)[0]}_"
                    for e in (_argument(node, "namespace", 99), _argument(node, "subsystem", 99))
                    if e is not None and evaluator.eval(e, scope)[0]
                )
            except Unresolved as error:
                contract.unresolved.append(f"{where}: {ast.unparse(node.func)}(...) — cannot read {error}")
                continue
            if len(kinds) > 1:
                contract.unresolved.append(f"{where}: {ast.unparse(node.func)} is one of {sorted(kinds)}")
                continue
            [kind] = kinds
            for raw_name, labels in itertools.product(names, label_sets):
                if not isinstance(raw_name, str):
                    contract.unresolved.append(f"{where}: name {raw_name!r} is not a string")
                    continue
                contract.add(Metric(family_name(prefix + raw_name, kind), kind, labels, where))
    return contract


def _bound_files(sources: dict[str, str], bindings: dict[str, tuple[str, str, str]] | None) -> dict[str, str]:
    return {path: sources[path] for path, _, _ in (bindings or {}).values()}


# --- reading a wheel ----------------------------------------------------------------------------


def wheel_sources(
    wheel: Path, package: str, *, exclude: Iterable[str] = ("/test/", "/tests/")
) -> dict[str, str]:
    """The package's .py files inside a wheel (path → text), tests left out."""
    sources: dict[str, str] = {}
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            path = info.filename
            if not path.startswith(f"{package}/") or not path.endswith(".py"):
                continue
            if any(part in f"/{path}" for part in exclude):
                continue
            sources[path] = archive.read(info).decode("utf-8", errors="replace")
    return sources


def dataclass_fields(source: str, class_name: str) -> set[str]:
    """Annotated instance fields of a class (ClassVar left out): what `self.__dict__` holds."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return {
                stmt.target.id
                for stmt in node.body
                if isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and "ClassVar" not in ast.unparse(stmt.annotation)
            }
    raise LookupError(f"no class {class_name}")
