"""docs/architecture.md's layer table states the package's real import order.

The table lists every file of ``fsdp_compose/`` in one row, rows from the top layer down; a file may
import files of its own row and of the rows below it. The imports are read with ``ast`` (relative ones
resolved; function-level and ``TYPE_CHECKING`` imports count), so the check runs no code and no process.
A package's ``__init__.py``, which Python runs before any module under it, counts only for what it imports
itself and for explicit imports of the package.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from expecttest import assert_expected_inline

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "fsdp_compose"
DOC = REPO / "docs" / "architecture.md"
TABLE_HEADER = "| layer | files | knows about |"

# Imports that go up the table on purpose: (importing file, imported file) -> why. Empty: none do.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Layer:
    name: str
    files: tuple[str, ...]  # as written, relative to fsdp_compose/


def _backticked_outside_parentheses(cell: str) -> list[str]:
    """The `code` spans of a cell that are not inside a parenthesised description."""
    spans, depth = [], 0
    for i, piece in enumerate(cell.split("`")):
        if i % 2:  # inside backticks
            if depth == 0:
                spans.append(piece)
        else:
            depth += piece.count("(") - piece.count(")")
    return spans


def parse_layers(markdown: str) -> list[Layer]:
    """The layer table's rows, top layer first. A file is a backticked ``.py`` path outside parentheses."""
    lines = markdown.splitlines()
    start = lines.index(TABLE_HEADER) + 2  # skip the header and the | --- | row
    layers = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        name, files_cell, _knows = (cell.strip() for cell in line.strip().strip("|").split("|"))
        files = [span.removeprefix("fsdp_compose/") for span in _backticked_outside_parentheses(files_cell)]
        layers.append(Layer(name, tuple(f for f in files if f.endswith(".py"))))
    return layers


def _module_files() -> dict[str, str]:
    """Dotted module name -> file path relative to fsdp_compose/, for every file of the package."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        parts = ("fsdp_compose", *path.relative_to(PACKAGE).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = relative
    return modules


def _imported_modules(tree: ast.AST, package: str, modules: set[str]) -> set[str]:
    """The package modules the tree's import statements name, relative imports resolved against ``package``.

    ``import a.b`` names ``a.b``; ``from a import b`` names ``a.b`` when that is a module, else ``a`` (b is one
    of a's attributes). Parent packages that Python loads on the way are not named.
    """
    named = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base_parts = parts[: len(parts) - node.level + 1] if node.level else []
            base = ".".join(base_parts + ([node.module] if node.module else []))
            named |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    return named & modules


def package_imports() -> dict[str, set[str]]:
    """File -> the package files it imports (paths relative to fsdp_compose/)."""
    modules = _module_files()
    imports = {}
    for module, relative in modules.items():
        package = module if relative.endswith("__init__.py") else module.rpartition(".")[0]
        named = _imported_modules(ast.parse((PACKAGE / relative).read_text()), package, set(modules))
        imports[relative] = {modules[name] for name in named} - {relative}
    return imports


def layering_problems(
    layers: list[Layer],
    files: set[str],
    imports: dict[str, set[str]],
    allowed_upward: dict[tuple[str, str], str],
) -> list[str]:
    """Every way the table and the imports disagree, one line each."""
    problems = []
    rows_of: dict[str, list[int]] = {}
    for row, layer in enumerate(layers):
        if not layer.files:
            problems.append(f"layer {layer.name!r} names no file")
        for file in layer.files:
            rows_of.setdefault(file, []).append(row)
    for file in sorted(rows_of):
        if file not in files:
            problems.append(
                f"the table names fsdp_compose/{file} (layer {layers[rows_of[file][0]].name!r}), which does not exist"
            )
        elif len(rows_of[file]) > 1:
            names = ", ".join(repr(layers[row].name) for row in rows_of[file])
            problems.append(f"fsdp_compose/{file} is in {len(rows_of[file])} places: {names}")
    problems += [f"fsdp_compose/{file} is in no layer" for file in sorted(files - rows_of.keys())]

    def label(file: str) -> str:
        return f"fsdp_compose/{file} (layer {layers[rows_of[file][0]].name!r})"

    upward = set()
    for file in sorted(imports):
        for target in sorted(imports[file]):
            if file in rows_of and target in rows_of and rows_of[target][0] < rows_of[file][0]:
                upward.add((file, target))
                if (file, target) not in allowed_upward:
                    problems.append(f"{label(file)} imports {label(target)}")
    problems += [
        f"ALLOWED_UPWARD lists fsdp_compose/{file} -> fsdp_compose/{target}, which is no upward import"
        for file, target in sorted(allowed_upward.keys() - upward)
    ]
    return problems


def test_layer_table_matches_imports():
    layers = parse_layers(DOC.read_text())
    assert len(layers) >= 5, f"expected the layer table under {TABLE_HEADER!r} in {DOC}, parsed {layers}"
    imports = package_imports()
    problems = layering_problems(layers, set(imports), imports, ALLOWED_UPWARD)
    assert not problems, "docs/architecture.md's layer table disagrees with the imports:\n" + "\n".join(problems)


def test_imports_are_read_from_every_kind_of_import_statement():
    """Spot checks: a TYPE_CHECKING import (the package has none left: a sample), and on the real package a
    ``from ..pkg import module`` and an ``__init__``."""
    imports = package_imports()
    guarded = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .group import ParamGroup\n")
    assert _imported_modules(guarded, "fsdp_compose.runtime", set(_module_files())) == {"fsdp_compose.runtime.group"}
    assert "whole_model/checkpoint_integrity.py" in imports["whole_model/checkpoint.py"]  # from . import ... as
    assert "whole_model/__init__.py" not in imports["whole_model/checkpoint.py"]
    assert "observe/memory.py" in imports["observe/explain.py"]  # from . import memory, plan
    assert "api.py" in imports["__init__.py"]


def test_table_rows_name_files_outside_parentheses():
    markdown = "\n".join(
        [
            "intro",
            TABLE_HEADER,
            "| --- | --- | --- |",
            "| top | `fsdp_compose/api.py` (`fully_shard`, see `wrap.py`), `runtime/x.py`; beside it, `compat/` | all |",
            "| bottom | `policies.py` (`f(x)` data) | nothing |",
            "",
            "| not | `a.py` | part |",
        ]
    )
    assert parse_layers(markdown) == [
        Layer("top", ("api.py", "runtime/x.py")),
        Layer("bottom", ("policies.py",)),
    ]


def test_problems_are_reported_by_file_and_layer():
    layers = [
        Layer("API", ("api.py", "gone.py")),
        Layer("runtime", ("runtime/x.py", "runtime/y.py", "api.py")),
        Layer("empty", ()),
    ]
    files = {"api.py", "runtime/x.py", "runtime/y.py", "runtime/z.py"}
    imports = {"api.py": {"runtime/x.py"}, "runtime/x.py": {"runtime/y.py"}, "runtime/y.py": {"api.py"}}
    allowed = {("runtime/x.py", "api.py"): "a stale entry"}
    assert_expected_inline(
        "\n".join(layering_problems(layers, files, imports, allowed)),
        """\
layer 'empty' names no file
fsdp_compose/api.py is in 2 places: 'API', 'runtime'
the table names fsdp_compose/gone.py (layer 'API'), which does not exist
fsdp_compose/runtime/z.py is in no layer
fsdp_compose/runtime/y.py (layer 'runtime') imports fsdp_compose/api.py (layer 'API')
ALLOWED_UPWARD lists fsdp_compose/runtime/x.py -> fsdp_compose/api.py, which is no upward import""",
    )
