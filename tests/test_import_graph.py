"""The layout's arrows, held by reading every import (docs/architecture.md): no circles, and imports run
one way, from the HTTP APIs down to the engine, from the engine down to the model and its layers, down
to the kernels.

Every import counts, at the top of a module or inside a function (a lazy import is still an arrow), and
those under `if TYPE_CHECKING:` too: a type-only import upward is still a module that knows the one above.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGES = ("backend", "inference_api", "proxy")

# Each module's tier and unit, by the longest prefix that names it: a module imports from its own tier
# only within its own unit, and otherwise only from lower tiers.
TIERS = {
    "inference_api": (9, "inference_api"),  # the package (it exports create_app), the app, the command
    "inference_api.app": (9, "inference_api"),
    "inference_api.__main__": (9, "inference_api"),
    "inference_api.apis": (8, "inference_api.apis"),  # one unit an API: openai may not import anthropic
    "inference_api.": (7, "inference_api."),  # the shared pieces: router, generation, prompts, fields, ...
    "backend": (6, "backend"),  # the package and what the frontend starts: process, mock, prepare
    "backend.engine": (5, "backend.engine"),
    "backend.model": (4, "backend.model"),
    "backend.layers": (3, "backend.layers"),
    "backend.quant": (3, "backend.quant"),
    "backend.kernels": (2, "backend.kernels"),
    "backend.utils": (1, "backend.utils"),
    "backend.messages": (1, "backend.messages"),  # the processes' contract: plain data, for anyone
}
# Within these, each subpackage is its own unit (an API imports no other API).
UNITS_WITHIN = ("inference_api.apis",)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {
        module_name(path): path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if ".venv" not in path.parts
    }


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules this file imports, wherever in the file the import is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + [base]
                ).strip(".")
            # `from backend.layers import sampler` imports the module backend.layers.sampler
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def tier_and_unit(name: str) -> tuple[int, str]:
    """The module's tier, and the unit within which it may import from its own tier."""
    prefix = max(
        (p for p in TIERS if name == p or name.startswith(p if p.endswith(".") else p + ".")), key=len
    )
    tier, unit = TIERS[prefix]
    for within in UNITS_WITHIN:
        if name.startswith(within + "."):
            unit = ".".join(name.split(".")[: len(within.split(".")) + 1])
    return tier, unit


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, name, modules) for name, path in modules.items()}


def test_the_graph_is_read(graph):
    """The check below can fail: the graph holds the arrows the layout is made of."""
    assert "backend.model.loader" in graph["backend.engine.engine"]
    assert "backend.messages" in graph["inference_api.router"]
    assert "backend.engine.serve" in graph["backend.process"]  # an import inside a function


def test_no_module_imports_itself_back(graph):
    """No circles: a depth-first walk never meets a module still on its own path."""
    on_path: list[str] = []
    done: set[str] = set()
    circles: list[list[str]] = []

    def visit(name: str) -> None:
        on_path.append(name)
        for target in sorted(graph[name]):
            if target in on_path:
                circles.append(on_path[on_path.index(target) :] + [target])
            elif target not in done:
                visit(target)
        on_path.pop()
        done.add(name)

    for name in sorted(graph):
        if name not in done:
            visit(name)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(circle) for circle in circles)


def test_imports_run_down_the_tiers(graph):
    upward = []
    for name, targets in graph.items():
        if name.startswith("proxy"):
            upward += [(name, t) for t in targets if not t.startswith("proxy")]  # the proxy stands alone
            continue
        tier, unit = tier_and_unit(name)
        for target in targets:
            target_tier, target_unit = tier_and_unit(target)
            if target_tier > tier or (target_tier == tier and target_unit != unit):
                upward.append((name, target))
    assert not upward, "imports against the layout:\n" + "\n".join(f"{a} -> {b}" for a, b in sorted(upward))


def test_a_circle_and_an_upward_import_would_be_caught():
    """The rules themselves, on a made-up graph: the checks above are not vacuous."""
    assert tier_and_unit("backend.layers.sampler") == (3, "backend.layers")
    assert tier_and_unit("backend.engine.engine")[0] > tier_and_unit("backend.model.loader")[0]
    assert tier_and_unit("inference_api.apis.openai.request") == (8, "inference_api.apis.openai")
    assert tier_and_unit("inference_api.apis.anthropic.request")[1] != "inference_api.apis.openai"
    assert tier_and_unit("inference_api.router") == (7, "inference_api.")
    assert tier_and_unit("backend.process") == (6, "backend")
    assert tier_and_unit("backend.quant.block_weights")[1] != tier_and_unit("backend.layers.sampler")[1]
