"""The house's floors as a contract (docs/architecture.md): no import cycle, no import up a floor.

Every import of every module under diffmeg/, tools/ and benchmarks/ (any folder depth, so a package such as
benchmarks/campaign/ is read like the rest) and of pretrain_diff.py counts, wherever it stands: at module
level, inside a function (a lazy import hides a loop from Python, not from a reader) and under
`if TYPE_CHECKING` (a type a signature names is a dependency a reader must hold in mind too). The imports
are read from the source with `ast`; nothing is imported.

FLOORS below is the one declaration of the layers, top floor first; docs/architecture.md shows the same
table. A module may import what stands on a lower floor, and on its own floor what is in its own room or,
where the floor is not `independent`, in another room of it; NEVER adds rules that must hold whatever the
floors become.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("diffmeg", "tools", "benchmarks")
SOURCE_FILES = ("pretrain_diff.py",)
DOC = REPO_ROOT / "docs" / "architecture.md"


@dataclass(frozen=True)
class Floor:
    name: str
    rooms: dict[str, tuple[str, ...]]
    """Room name -> the modules in it (a name covers the module and everything below it: a package)."""
    independent: bool = False
    """The rooms of this floor never import one another."""


FLOORS = [
    Floor(
        "entry points",
        {"pretrain_diff": ("pretrain_diff",), "tools": ("tools",), "benchmarks": ("benchmarks",)},
        independent=True,
    ),
    Floor("command line", {"cli": ("diffmeg.cli",), "launch": ("diffmeg.launch",)}, independent=True),
    Floor("evaluation", {"eval": ("diffmeg.eval",)}),
    Floor("model sources", {"model_source": ("diffmeg.model_source",)}),
    Floor("conversion", {"conversion": ("diffmeg.conversion",)}),
    Floor(
        "training and generation",
        {"training": ("diffmeg.training",), "generation": ("diffmeg.generation",)},
        independent=True,
    ),
    Floor("checkpoints", {"checkpoints": ("diffmeg.checkpoints",)}),
    Floor(
        "model and data",
        {
            "model": (
                "diffmeg.model",
                "diffmeg.layer_specs",
                "diffmeg.init",
                "diffmeg.presets",
                "diffmeg.attention",
                "diffmeg.attention_v2",
                "diffmeg.self_attention",
                "diffmeg.mlp",
                "diffmeg.core_attention",
                "diffmeg.registry",
                "diffmeg.fusions",
                "diffmeg.kernels",
                "diffmeg.parallel",
                "diffmeg.config",
                "diffmeg.run_config",
            ),
            "data": ("diffmeg.data",),
        },
        independent=True,
    ),
    Floor("process", {"runtime": ("diffmeg.runtime", "diffmeg.compat", "diffmeg.collectives")}),
    Floor("ground", {"ground": ("diffmeg.errors", "diffmeg.storage", "diffmeg.folder_lock")}),
]

NEVER = [
    ("diffmeg", "tools", "the package never imports its command-line entry points"),
    ("diffmeg", "benchmarks", "the package never imports the benchmarks"),
    ("diffmeg", "pretrain_diff", "the package never imports its training entry point"),
    ("diffmeg", "tests", "the package never imports its tests"),
    ("tools", "tests", "a tool never imports the tests"),
    ("benchmarks", "tests", "a benchmark never imports the tests"),
    ("diffmeg.eval", "diffmeg.training", "evaluation reads models through checkpoints, never the trainer"),
]
"""(importer, imported, why): no module under the first may import one under the second."""

ROOT_PACKAGES = ("diffmeg",)
"""Package faces on no floor (diffmeg/__init__.py): they must import nothing of the house."""
TOOL_LINES = 300
"""A tool is a thin entry point over the package: at most this many lines."""


# ----------------------------------------------------------------------------------------------------
# The checker (tested itself on a synthetic package below)


@dataclass
class Graph:
    modules: dict[str, Path]
    """Module name -> its file."""
    imports: dict[str, dict[str, int]] = field(default_factory=dict)
    """Module -> {imported module of the house (or `tests`): line of its first import}."""


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def find_modules(root: Path, dirs: Iterable[str], files: Iterable[str] = ()) -> dict[str, Path]:
    """Every .py file under `dirs` (any depth, caches left out) and the given top-level `files`."""
    found: list[Path] = [root / f for f in files if (root / f).is_file()]
    for top in dirs:
        for folder, subdirs, names in os.walk(root / top):
            subdirs[:] = sorted(d for d in subdirs if d != "__pycache__" and not d.startswith("."))
            found += [Path(folder) / n for n in sorted(names) if n.endswith(".py")]
    return {module_name(root, p): p for p in found}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The house module `name` imports (its longest prefix that is one), `tests` for the tests, else None."""
    if _within(name, "tests"):
        return "tests"
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def read_imports(modules: dict[str, Path]) -> Graph:
    graph = Graph(modules)
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        found: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package this module is in (or is)
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    package = package[: len(package) - node.level + 1]
                    base = ".".join(package + ([node.module] if node.module else []))
                # `from pkg import mod` imports pkg.mod; `from mod import name` imports mod
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                resolved = _resolve(target, modules)
                if resolved and resolved != name:
                    found[resolved] = min(found.get(resolved, node.lineno), node.lineno)
        graph.imports[name] = found
    return graph


def _where(graph: Graph, importer: str, imported: str) -> str:
    path = graph.modules[importer]
    shown = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    return f"{shown}:{graph.imports[importer][imported]}"


def find_cycles(graph: Graph) -> list[str]:
    """One line per import cycle (a strongly connected set of modules): one loop through it, each import
    with its file and line."""
    edges = {m: [t for t in targets if t in graph.modules] for m, targets in graph.imports.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(start: str) -> None:  # Tarjan's algorithm, iteratively (no recursion limit to meet)
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    lines = []
    for component in components:
        members = set(component)
        start = component[0]
        # the shortest way back to `start` inside the component: one loop a reader can follow
        previous: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in previous:
            following = []
            for node in frontier:
                for child in edges[node]:
                    if child in members and child not in previous:
                        previous[child] = node
                        following.append(child)
            frontier = following
        loop = [start]
        while True:
            loop.append(previous[loop[-1]])
            if loop[-1] == start:
                break
        loop.reverse()
        pairs = zip(loop, loop[1:], strict=False)
        steps = ", ".join(f"{a} imports {b} ({_where(graph, a, b)})" for a, b in pairs)
        lines.append(f"import cycle of {len(component)} modules ({', '.join(component)}): {steps}")
    return lines


def floor_of(module: str, floors: list[Floor]) -> tuple[int, str] | None:
    """(floor index from the top, room name) of the longest declared name covering `module`."""
    best: tuple[int, int, str] | None = None
    for number, floor in enumerate(floors):
        for room, names in floor.rooms.items():
            for declared in names:
                if _within(module, declared) and (best is None or len(declared) > best[0]):
                    best = (len(declared), number, room)
    return None if best is None else (best[1], best[2])


def check_layers(
    graph: Graph,
    floors: list[Floor],
    never: Iterable[tuple[str, str, str]] = (),
    root_packages: Iterable[str] = (),
) -> list[str]:
    """One line per module on no floor, per import up a floor, across independent rooms, or broken rule."""
    problems = []
    roots = set(root_packages)
    for module in sorted(graph.modules):
        if module in roots:
            problems += [
                f"{_where(graph, module, t)}: {module} is a package face on no floor; it imports {t}"
                for t in graph.imports[module]
            ]
        elif floor_of(module, floors) is None:
            problems.append(
                f"{graph.modules[module]}: {module} is on no floor; add it to FLOORS in "
                "tests/test_architecture.py and to docs/architecture.md"
            )
    for floor in floors:
        for names in floor.rooms.values():
            for declared in names:
                if not any(_within(m, declared) for m in graph.modules):
                    problems.append(f"floor {floor.name!r} names {declared}, which is no module any more")
    for module in sorted(graph.imports):
        here = floor_of(module, floors)
        for target in sorted(graph.imports[module]):
            for importer, imported, why in never:
                if _within(module, importer) and _within(target, imported):
                    problems.append(f"{_where(graph, module, target)}: {module} imports {target}, but {why}")
            there = floor_of(target, floors) if target in graph.modules else None
            if here is None or there is None:
                continue
            if there[0] < here[0]:
                problems.append(
                    f"{_where(graph, module, target)}: {module} (floor {floors[here[0]].name!r}) imports "
                    f"{target} (floor {floors[there[0]].name!r}), a floor above it; move the shared "
                    "concern down to a module both may import (docs/architecture.md)"
                )
            elif there[0] == here[0] and there[1] != here[1] and floors[here[0]].independent:
                problems.append(
                    f"{_where(graph, module, target)}: {module} imports {target}, but rooms {here[1]!r} and "
                    f"{there[1]!r} of floor {floors[here[0]].name!r} are independent"
                )
    return problems


# ----------------------------------------------------------------------------------------------------
# The contract


@pytest.fixture(scope="module")
def house() -> Graph:
    return read_imports(find_modules(REPO_ROOT, SOURCE_DIRS, SOURCE_FILES))


def test_no_import_cycle(house):
    cycles = find_cycles(house)
    assert not cycles, "give the shared concern its own module below both sides:\n" + "\n".join(cycles)


def test_imports_follow_the_floors(house):
    problems = check_layers(house, FLOORS, NEVER, ROOT_PACKAGES)
    assert not problems, "\n".join(problems)


def test_tools_are_thin_entry_points():
    sizes = {p.name: len(p.read_text().splitlines()) for p in sorted((REPO_ROOT / "tools").glob("*.py"))}
    long = {name: n for name, n in sizes.items() if n > TOOL_LINES}
    assert not long, f"tools over {TOOL_LINES} lines, move their logic into the package: {long}"


def _doc_path(name: str) -> str:
    path = REPO_ROOT / name.replace(".", "/")
    return f"{name.replace('.', '/')}/" if path.is_dir() else f"{name.replace('.', '/')}.py"


def test_the_architecture_page_shows_these_floors():
    """docs/architecture.md's floor table: one row per floor, top first, naming every room's modules."""
    rows = [line for line in DOC.read_text().splitlines() if re.match(r"\|\s*\d+\s*\|", line)]
    names = [re.split(r"\s*\|\s*", row)[2] for row in rows]
    assert names == [f.name for f in FLOORS], "docs/architecture.md's floor table differs from FLOORS"
    for row, floor in zip(rows, FLOORS, strict=True):
        for declared in (n for names in floor.rooms.values() for n in names):
            assert f"`{_doc_path(declared)}`" in row, f"docs/architecture.md: {floor.name!r} lacks {declared}"


# ----------------------------------------------------------------------------------------------------
# The checker itself, on a synthetic package


def _package(root: Path, files: dict[str, str]) -> Graph:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return read_imports(find_modules(root, ["pkg"]))


def test_the_checker_finds_cycles_through_lazy_relative_and_type_checking_imports(tmp_path):
    graph = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "def f():\n    from pkg import b\n",
            "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.c import X\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/c.py": "import os\nfrom ..a import f\n",
            "pkg/d.py": "import pkg.a\n",
        },
    )
    (cycle,) = find_cycles(graph)
    assert "3 modules (pkg.a, pkg.b, pkg.sub.c)" in cycle
    assert "pkg.a imports pkg.b" in cycle and "a.py:2" in cycle and "pkg.sub.c imports pkg.a" in cycle
    (tmp_path / "pkg/sub/c.py").write_text("import os\n")
    assert find_cycles(read_imports(find_modules(tmp_path, ["pkg"]))) == []


def test_the_checker_refuses_imports_up_across_and_on_no_floor(tmp_path):
    graph = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/top.py": "from pkg.low import x\nfrom pkg import side\n",
            "pkg/side.py": "",
            "pkg/low/__init__.py": "",
            "pkg/low/x.py": "def f():\n    import pkg.top\n",
            "pkg/stray.py": "import tests.helpers\n",
        },
    )
    floors = [
        Floor("upper", {"top": ("pkg.top",), "side": ("pkg.side",)}, independent=True),
        Floor("lower", {"low": ("pkg.low", "pkg.gone")}),
    ]
    problems = check_layers(graph, floors, [("pkg", "tests", "no tests")], ["pkg"])
    text = "\n".join(problems)
    assert "pkg.low.x (floor 'lower') imports pkg.top (floor 'upper'), a floor above it" in text
    assert "x.py:2" in text
    assert "rooms 'top' and 'side' of floor 'upper' are independent" in text
    assert "pkg.stray is on no floor" in text and "names pkg.gone, which is no module" in text
    assert "pkg.stray imports tests, but no tests" in text
    assert len(problems) == 5
    floors[0] = Floor("upper", {"top": ("pkg.top",), "side": ("pkg.side",)})
    (tmp_path / "pkg/low/x.py").write_text("")
    assert len(check_layers(read_imports(find_modules(tmp_path, ["pkg"])), floors, [], ["pkg"])) == 2
