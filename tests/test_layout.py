"""The package's shape: no import circle (function-level imports count), ``engine.py`` a facade, no package
named ``dist``, no top-level name of the repository that hides an installed package, the renamed modules
importable under their old names for one release (with a warning), and the PPO rank helpers free of the
demo."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "oppo_engine"
ENGINE_MAX_LINES = 450


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports when it runs: at the top, in functions and in classes
    (what runs only for a type checker does not count)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_package_has_no_import_circle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert sum(map(len, graph.values())) > 100  # the graph was read, not empty
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_function_level_circle(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from pkg import b\n")
    graph = {"pkg.a": _imports("pkg.a", a, {"pkg.a": a, "pkg.b": a}), "pkg.b": {"pkg.a"}}
    assert _cycles(graph) == [["pkg.a", "pkg.b"]]


def test_engine_py_is_a_facade():
    lines = len((PACKAGE / "engine.py").read_text().splitlines())
    assert lines <= ENGINE_MAX_LINES, f"oppo_engine/engine.py has {lines} lines (budget {ENGINE_MAX_LINES})"


def test_no_package_is_named_like_build_output():
    assert not (PACKAGE / "dist").exists()
    assert not [p for p in PACKAGE.rglob("*") if p.is_dir() and p.name in ("dist", "build")]


def _shadowing(root: Path, provided: dict[str, list[str]]) -> dict[str, list[str]]:
    """The modules and regular packages at the top of ``root`` that share a name with a top-level module of
    an installed distribution other than this project (``provided``: module -> distributions)."""
    ours = {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    ours |= {p.stem for p in root.glob("*.py")}
    return {name: provided[name] for name in sorted(ours - {"oppo_engine"}) if name in provided}


def test_no_top_level_name_of_the_repository_shadows_an_installed_package():
    """pytest (``pythonpath = ["."]``) and ``python -m`` put the repository root first on ``sys.path``, so a
    package there hides an installed one of the same name: a top-level ``kernels/`` hid Hugging Face's
    ``kernels``, which transformers 5.25 requires and imports, and every test failed to collect."""
    provided = importlib.metadata.packages_distributions()
    assert _shadowing(ROOT, provided) == {}


def test_the_shadowing_check_finds_a_package_named_like_an_installed_one(tmp_path):
    (tmp_path / "numpy").mkdir()
    (tmp_path / "numpy" / "__init__.py").write_text("")
    (tmp_path / "yaml.py").write_text("")
    (tmp_path / "docs").mkdir()  # not a package: an installed one of the name would still win
    found = _shadowing(tmp_path, importlib.metadata.packages_distributions())
    assert set(found) == {"numpy", "yaml"} and "numpy" in found["numpy"]


def _run(code: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", code]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


RENAMED = [
    ("oppo_engine.dist", "oppo_engine.distributed"),
    ("oppo_engine.dist.group", "oppo_engine.distributed.group"),
    ("oppo_engine.dist.service", "oppo_engine.distributed.service"),
    ("oppo_engine.ppo.distributed", "oppo_engine.ppo.ranks"),
]

# Run in a fresh interpreter (what a module imports, and what warns, depends on what was imported before).
_ALIASES = """
import importlib, json, sys, warnings
out = {}
for old, new in RENAMED:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old_module = importlib.import_module(old)
    new_module = importlib.import_module(new)
    names = [] if old_module is new_module else new_module.__all__
    out[old] = dict(
        same_module=old_module is new_module,
        names=len(names),
        same_objects=all(getattr(old_module, n) is getattr(new_module, n) for n in names),
        warned=[str(w.message) for w in caught if issubclass(w.category, FutureWarning)],
    )
print(json.dumps(out))
"""


def test_a_renamed_module_imports_under_its_old_name_and_warns():
    run = _run(f"RENAMED = {RENAMED!r}\n" + _ALIASES)
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout)
    for old, new in RENAMED:
        got = found[old]
        # A submodule's old name is the new module itself; a package's alias re-exports every public name.
        assert got["same_module"] == old.startswith("oppo_engine.dist."), (old, got)
        assert got["same_module"] or (got["names"] > 0 and got["same_objects"]), (old, got)
        if not got["same_module"]:  # the alias module warns once, when first imported (its submodules after)
            assert any(f"is renamed {new};" in w for w in got["warned"]), (old, got)


def test_the_old_dist_names_are_the_new_objects():
    run = _run(
        "from oppo_engine.dist import ScorerService, RemoteScorers\n"
        "from oppo_engine.dist.group import GroupFailed\n"
        "import oppo_engine.distributed as d\n"
        "assert ScorerService is d.ScorerService and RemoteScorers is d.RemoteScorers\n"
        "assert GroupFailed is d.GroupFailed\n"
    )
    assert run.returncode == 0, run.stderr


def test_the_ppo_rank_helpers_import_nothing_from_the_demo():
    run = _run(
        "import importlib, sys, warnings\n"
        "warnings.simplefilter('ignore')\n"
        "for module in ('oppo_engine.ppo.ranks', 'oppo_engine.ppo.distributed', 'oppo_engine.ppo.trainer'):\n"
        "    importlib.import_module(module)\n"
        "    demo = sorted(m for m in sys.modules if m.startswith('oppo_engine.ppo.demo'))\n"
        "    assert not demo, (module, demo)\n"
    )
    assert run.returncode == 0, run.stderr
