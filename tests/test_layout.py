"""The package's layers (kappa/__init__.py, the README map): each imports only from the layers below it, module-level
imports form no cycle, every package states its public API, and every KAPPA_* variable is read in Settings."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kappa"
#: lowest first; a module may import from its own layer and the ones before it
LAYERS = ["core", "log", "runtime", "verify", "control", "front"]
#: what view modules (jobs/<view>/v<N>.py) may use: the view authors' API; their oracles (oracle.py) also verify's
JOBS_MAY_IMPORT = {"core", "runtime"}
ORACLES_MAY_IMPORT = JOBS_MAY_IMPORT | {"verify"}


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return "core"


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported kappa module, line, at module level) of every import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    for node in tree.body:  # `if TYPE_CHECKING:` blocks and module-level try blocks count as module level
        if isinstance(node, (ast.If, ast.Try)):
            top |= {id(n) for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name == "kappa" or name.startswith("kappa."):
                out.append((_resolve(name), node.lineno, id(node) in top))
    return out


def _resolve(name: str) -> str:
    """The module a dotted import name refers to (``kappa.runtime.view.ViewDefinition`` -> ``kappa.runtime.view``)."""
    parts = name.split(".")
    while parts:
        candidate = ROOT.joinpath(*parts)
        if candidate.with_suffix(".py").is_file() or (candidate / "__init__.py").is_file():
            return ".".join(parts)
        parts.pop()
    raise AssertionError(f"{name} is not a module of this repository")


def _modules(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def test_each_layer_imports_only_from_the_layers_below_it():
    upward = []
    for path in _modules(PACKAGE):
        me = _module(path)
        for target, line, _ in _imports(path):
            if target == "kappa":  # the top-level package: lazy exports only
                continue
            if LAYERS.index(_layer(target)) > LAYERS.index(_layer(me)):
                upward.append(f"{path.relative_to(ROOT)}:{line} ({_layer(me)}) imports {target} ({_layer(target)})")
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_view_modules_use_only_the_view_authors_api():
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {target}"
             for path in _modules(ROOT / "jobs") for target, line, _ in _imports(path)
             if target != "kappa" and _layer(target) not in (
                 ORACLES_MAY_IMPORT if path.name == "oracle.py" else JOBS_MAY_IMPORT)]
    assert not wrong, "\n".join(wrong)


def test_module_level_imports_form_no_cycle():
    graph: dict[str, set[str]] = {}
    for path in _modules(PACKAGE):
        graph[_module(path)] = {t for t, _, top in _imports(path) if top and t != _module(path)}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]) if nxt in stack else nxt)
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "module-level import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("package", ["kappa", "kappa.log", "kappa.runtime", "kappa.verify", "kappa.control",
                                     "kappa.control.replay", "kappa.control.runners", "kappa.front"])
def test_every_package_states_a_public_api_that_resolves(package):
    mod = importlib.import_module(package)
    assert mod.__doc__ and mod.__all__, f"{package}: a docstring and __all__"
    for name in mod.__all__:
        assert getattr(mod, name) is not None, f"{package}.{name}"
    with pytest.raises(AttributeError):
        getattr(mod, "no_such_name")


def test_the_user_api_is_exported_at_the_top():
    import kappa
    from kappa.config import Settings
    from kappa.control.replay.request import ReplayRequest
    from kappa.runtime.testing import run_view
    from kappa.runtime.view import ViewDefinition

    assert (kappa.ViewDefinition, kappa.Settings, kappa.ReplayRequest, kappa.run_view) == (
        ViewDefinition, Settings, ReplayRequest, run_view)


def test_every_kappa_variable_is_read_in_settings():
    """KAPPA_* environment variables are read by kappa.config.Settings only (and documented there)."""
    read = re.compile(r"(?:environ(?:\.get)?|getenv)\(\s*[\"'](KAPPA_\w+)|environ\[\s*[\"'](KAPPA_\w+)")
    elsewhere = []
    for folder in (PACKAGE, ROOT / "dags", ROOT / "jobs"):
        for path in _modules(folder):
            if path == PACKAGE / "config.py":
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if read.search(line):
                    elsewhere.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not elsewhere, "KAPPA_* read outside Settings:\n" + "\n".join(elsewhere)
    config = (PACKAGE / "config.py").read_text()
    doc = importlib.import_module("kappa.config").__doc__
    for name in sorted(set(re.findall(r"get\(\"(KAPPA_\w+)\"|number\(\"(KAPPA_\w+)\"", config)) - {("", "")}):
        var = name[0] or name[1]
        assert var in doc, f"{var} is read by Settings but not documented in kappa/config.py"


def test_every_import_of_a_platform_name_resolves():
    """Also the imports inside functions (most of the package imports lazily), which a linter does not check."""
    missing = []
    for folder in (PACKAGE, ROOT / "dags", ROOT / "jobs", ROOT / "tests"):
        for path in _modules(folder):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                        and node.module.split(".")[0] in ("kappa", "jobs")):
                    continue
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if not hasattr(module, alias.name):
                        try:
                            importlib.import_module(f"{node.module}.{alias.name}")
                        except ModuleNotFoundError:
                            missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module} has no {alias.name}")
    assert not missing, "\n".join(missing)
