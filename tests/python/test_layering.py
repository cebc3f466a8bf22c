"""No import circle in the Python package: the modules of ``python/shmq`` import each
other along a graph without cycles.

Every import statement counts, wherever it is: at module level, inside a function or a
method (an import deferred to call time is still an arrow), under ``if TYPE_CHECKING:``.
``from X import name`` is an arrow to the module ``X.name`` when that is a module of the
package (``from . import group``), else to ``X`` itself (``from shmq import MessageQueue``
uses ``shmq/__init__.py``); ``shmq._core`` (the extension) imports nothing of the
package. The parents that Python loads before a submodule are not arrows of their own:
``shmq.workers.child`` is not in a circle with ``shmq.workers`` unless it imports from it.

On the Rust side the layers are crates of one cargo workspace: the compiler refuses an
import from a layer above.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "shmq"

# Modules of the package that are not .py files, and import nothing of it.
LEAVES = {"_core"}


def package_modules(package: Path) -> dict[str, Path]:
    """Dotted name -> file, for every .py file under ``package``."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = [package.name, *path.relative_to(package).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, modules: dict[str, Path]) -> dict[str, list[int]]:
    """The modules of the package that module ``name`` imports -> the lines that do."""
    is_package = path.name == "__init__.py"

    def known(dotted: str) -> str | None:
        parts = dotted.split(".")
        for k in range(len(parts), 0, -1):
            candidate = ".".join(parts[:k])
            if candidate in modules:
                return candidate
        return None

    out: dict[str, list[int]] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        targets: set[str | None] = set()
        if isinstance(node, ast.Import):
            targets = {known(alias.name) for alias in node.names}
        else:
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in modules:
                    targets.add(full)
                elif full.removeprefix(name.split(".")[0] + ".") not in LEAVES:
                    targets.add(known(source))
        for target in targets:
            if target is not None and target != name:
                out.setdefault(target, []).append(node.lineno)
    return out


def cycles(package: Path) -> list[str]:
    """One description per circle (strongly connected set of modules), with the import
    lines that close it; empty when there is none."""
    modules = package_modules(package)
    graph = {name: imports(name, path, modules) for name, path in modules.items()}

    # Tarjan's strongly connected components.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)

    root = package.parent
    out = []
    for component in found:
        arrows = [
            f"  {modules[a].relative_to(root)}:{','.join(map(str, lines))}: {a} imports {b}"
            for a in component
            for b, lines in sorted(graph[a].items())
            if b in component
        ]
        out.append(" <-> ".join(component) + "\n" + "\n".join(arrows))
    return out


def test_the_package_has_no_import_circle() -> None:
    found = cycles(PACKAGE)
    assert not found, "import circles in python/shmq:\n" + "\n".join(found)


def test_the_check_sees_circles_through_function_level_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("A = 1\n\ndef f():\n    from .sub import b\n    return b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("class B:\n    def g(self):\n        import pkg.c\n")
    (pkg / "c.py").write_text("from . import _core\nfrom .a import A\n")
    (pkg / "d.py").write_text("from .sub import b\n")  # an arrow, but no circle
    [found] = cycles(pkg)
    assert found.startswith("pkg.a <-> pkg.c <-> pkg.sub.b\n"), found
    assert "pkg/a.py:4: pkg.a imports pkg.sub.b" in found
    assert "pkg/sub/b.py:3: pkg.sub.b imports pkg.c" in found
    assert "pkg/c.py:2: pkg.c imports pkg.a" in found

    (pkg / "c.py").write_text("from . import _core\n")
    assert cycles(pkg) == []
