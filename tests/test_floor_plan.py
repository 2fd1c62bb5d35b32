"""The floor plan's rules that import-linter's contracts do not state: no module imports
itself back through others (a cycle of modules, lazy imports counted), and no module is over
600 lines (tests, checks and tools included)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "app", "widgets", "checks")
MOST_LINES = 600

pytestmark = pytest.mark.no_engine_paths


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm, iterative):
    each is a set of modules that import one another round a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []

    def edges(module: str) -> Iterator[str]:
        return iter(sorted(graph.find_modules_directly_imported_by(module)))

    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, edges(root))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, todo = work[-1]
            child = next(todo, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child))))
                    )
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))
    return found


def test_the_cycle_finder_finds_a_cycle_of_three_and_not_a_chain():
    graph = grimp.ImportGraph()
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d"), ("p.e", "p.d")):
        graph.add_import(importer=a, imported=b)
    assert cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_no_module_imports_itself_back_through_others(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)
    assert {"engine.core.engine", "app.cli.main", "widgets.tuner"} <= graph.modules
    assert cycles(graph) == []


def test_no_module_is_over_600_lines():
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert len(listed) > 300, sys.executable
    lines = {name: len((ROOT / name).read_text().splitlines()) for name in listed
             if (ROOT / name).exists()}  # fmt: skip
    long = {name: n for name, n in lines.items() if n > MOST_LINES}
    assert long == {}


def test_the_engine_and_the_server_import_without_triton():
    """Triton is the GPU's (and the dev extras'): a CPU-only install imports, loads and
    serves without it. Imported lazily where our Triton kernels run."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import engine.core.engine, engine.loader.load, engine.attention, engine.executor.step\n"
        "import app.server.routes, app.cli.main\n"
        "assert 'triton' not in {m.split('.')[0] for m, v in sys.modules.items() if v}\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
