"""docs/architecture.md's rings and layer table state the package's real import order.

Two rings: the core (``fsdp_compose/`` but ``extras/`` and ``optim/``) imports no extra, and names none in its code
but in ``__init__.py``'s table of lazily resolved public names; the extras (``fsdp_compose/extras/``, ``optim/``
and the ``fsdp_compose_shm`` package) import of the core only ``fsdp_compose``'s public names and
``fsdp_compose.extras_api``. Within the package, the layer table lists every file in one row, rows from the top
layer down; a file may import files of its own row and of the rows below it. The imports are read with ``ast``
(relative ones resolved; function-level and ``TYPE_CHECKING`` imports count), so the check runs no code and no
process. A package's ``__init__.py``, which Python runs before any module under it, counts only for what it
imports itself and for explicit imports of the package.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from expecttest import assert_expected_inline

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "fsdp_compose"
DOC = REPO / "docs" / "architecture.md"
TABLE_HEADER = "| layer | files | knows about |"

# Imports that go up the table on purpose: (importing file, imported file) -> why. Empty: none do.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}

# the extras ring: folders of fsdp_compose/ (optim/ takes only extras_api's row_layout), and packages beside it
EXTRA_FOLDERS = ("extras/", "optim/")
EXTRA_PACKAGES = (REPO / "fsdp_compose_shm",)
EXTRA_MODULE_PREFIXES = ("fsdp_compose.extras", "fsdp_compose.optim", "fsdp_compose_shm")
EXTRAS_API = "extras_api.py"  # the one core module the extras may import besides the package's public names
# core files whose code names an extra by string, on purpose: (file, extra's module) -> why
NAMED_BY_STRING: dict[tuple[str, str], str] = {
    ("__init__.py", "fsdp_compose.extras.observe.explain"): "explain, Explanation, collective_bytes: lazy re-export",
    ("__init__.py", "fsdp_compose.extras.observe.estimate"): "estimate, Estimate: lazy re-export",
    ("__init__.py", "fsdp_compose.extras.plan.planner"): "plan, Plan, BudgetError: lazy re-export",
    ("__init__.py", "fsdp_compose.extras.checkpoint"): "save_checkpoint, load_checkpoint, CheckpointError, ...: lazy re-export",
    ("__init__.py", "fsdp_compose.extras.quantize"): "quantize_all_gather: lazy re-export",
    ("__init__.py", "fsdp_compose.extras.wrap"): "apply_fully_shard and its policies: lazy re-export",
    ("__init__.py", "fsdp_compose.extras.deferred_init"): "init_sharded_parameters, sync_module_states: lazy re-export",
    ("__init__.py", "fsdp_compose.extras.pretrained"): "load_pretrained, save_pretrained, ...: lazy re-export",
    ("__init__.py", "fsdp_compose.extras.fault_tolerance"): "FaultTolerance, FaultToleranceError: lazy re-export",
}


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


def is_extra(file: str) -> bool:
    return file.startswith(EXTRA_FOLDERS)


def _code_strings(tree: ast.AST) -> set[str]:
    """String constants of the tree's code, docstrings left out."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    }


def _names_from_package(tree: ast.AST, package: str) -> set[str]:
    """The names ``from fsdp_compose import ...`` (absolute, or relative resolving to it) takes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join((parts[: len(parts) - node.level + 1] if node.level else []) + [node.module or ""])
            if base.strip(".") == "fsdp_compose":
                names |= {alias.name for alias in node.names}
    return names


def public_names() -> set[str]:
    """``fsdp_compose.__all__``, read from the source."""
    for node in ast.parse((PACKAGE / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("fsdp_compose/__init__.py has no __all__")


def ring_problems(
    imports: dict[str, set[str]],
    strings: dict[str, set[str]],
    taken: dict[str, set[str]],
    public: set[str],
    named_by_string: dict[tuple[str, str], str],
) -> list[str]:
    """Every way the two rings break their rule, one line each.

    ``imports``: file -> package files it imports; ``strings``: core file -> its code's strings; ``taken``: extra
    -> the names it takes from ``fsdp_compose`` itself. Files outside fsdp_compose/ are named from the repository.
    """
    def label(file: str) -> str:
        return file if file.startswith(tuple(p.name + "/" for p in EXTRA_PACKAGES)) else f"fsdp_compose/{file}"

    problems = []
    for file in sorted(imports):
        for target in sorted(imports[file]):
            if not is_extra(file) and is_extra(target) and file in strings:
                problems.append(f"core file {label(file)} imports the extra {label(target)}")
            elif file not in strings and not is_extra(target) and target not in ("__init__.py", EXTRAS_API):
                problems.append(f"extra {label(file)} imports {label(target)}, which is neither public nor a view")
    named = set()
    for file in sorted(strings):
        for text in sorted(strings[file]):
            if text.startswith(EXTRA_MODULE_PREFIXES):
                named.add((file, text))
                if (file, text) not in named_by_string:
                    problems.append(f"core file {label(file)} names the extra {text!r}")
    problems += [
        f"NAMED_BY_STRING lists fsdp_compose/{file} -> {text!r}, which that file does not name"
        for file, text in sorted(named_by_string.keys() - named)
    ]
    for file in sorted(taken):
        problems += [
            f"extra {label(file)} takes {name!r} from fsdp_compose, which is not in its __all__"
            for name in sorted(taken[file] - public - {"extras_api"})
        ]
    return problems


def ring_inputs() -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, set[str]]]:
    """``ring_problems``' inputs from the sources: the package's files and the extra packages beside it."""
    modules = _module_files()
    imports, strings, taken = package_imports(), {}, {}
    for module, relative in modules.items():
        tree = ast.parse((PACKAGE / relative).read_text())
        package = module if relative.endswith("__init__.py") else module.rpartition(".")[0]
        if is_extra(relative):
            taken[relative] = _names_from_package(tree, package)
        else:
            strings[relative] = _code_strings(tree)
    for root in EXTRA_PACKAGES:
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            package = ".".join(parts if parts[-1] == "__init__" else parts[:-1]).removesuffix(".__init__")
            tree = ast.parse(path.read_text())
            name = path.relative_to(REPO).as_posix()
            imports[name] = {modules[m] for m in _imported_modules(tree, package, set(modules))}
            taken[name] = _names_from_package(tree, package)
    return imports, strings, taken


def test_core_imports_no_extra_and_extras_only_public_names_and_extras_api():
    imports, strings, taken = ring_inputs()
    assert any(name.startswith("fsdp_compose_shm/") for name in imports), "the shm package was not read"
    problems = ring_problems(imports, strings, taken, public_names(), NAMED_BY_STRING)
    assert not problems, "the rings of docs/architecture.md are broken:\n" + "\n".join(problems)


def test_ring_problems_are_reported():
    imports = {
        "api/fully_shard.py": {"extras/quantize.py", "_runtime/state.py"},
        "extras/quantize.py": {"extras_api.py", "_runtime/state.py", "__init__.py"},
        "fsdp_compose_shm/__init__.py": {"_checks/order.py"},
    }
    strings = {
        "api/fully_shard.py": {"fsdp_compose.extras.observe", "fine"},
        "api/comm.py": {"fsdp_compose_shm", "shm"},  # a package beside the core, named by string
        "__init__.py": {"fsdp_compose.extras.quantize"},  # declared below: no problem
        "_runtime/state.py": set(),
    }
    taken = {"extras/quantize.py": {"fully_shard", "extras_api", "state_of"}}
    named = {("__init__.py", "fsdp_compose.extras.quantize"): "declared", ("api/mesh.py", "fsdp_compose_shm"): "stale"}
    assert_expected_inline(
        "\n".join(ring_problems(imports, strings, taken, {"fully_shard"}, named)),
        """\
core file fsdp_compose/api/fully_shard.py imports the extra fsdp_compose/extras/quantize.py
extra fsdp_compose/extras/quantize.py imports fsdp_compose/_runtime/state.py, which is neither public nor a view
extra fsdp_compose_shm/__init__.py imports fsdp_compose/_checks/order.py, which is neither public nor a view
core file fsdp_compose/api/comm.py names the extra 'fsdp_compose_shm'
core file fsdp_compose/api/fully_shard.py names the extra 'fsdp_compose.extras.observe'
NAMED_BY_STRING lists fsdp_compose/api/mesh.py -> 'fsdp_compose_shm', which that file does not name
extra fsdp_compose/extras/quantize.py takes 'state_of' from fsdp_compose, which is not in its __all__""",
    )


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
    assert _imported_modules(guarded, "fsdp_compose._runtime", set(_module_files())) == {"fsdp_compose._runtime.group"}
    assert "extras/checkpoint/integrity.py" in imports["extras/checkpoint/save_load.py"]  # from . import module
    assert "extras/checkpoint/__init__.py" not in imports["extras/checkpoint/save_load.py"]
    assert "extras/observe/memory.py" in imports["extras/observe/explain.py"]  # from . import memory, plan
    assert "extras_api.py" in imports["extras/observe/explain.py"]  # from ..extras_api import
    assert "api/fully_shard.py" in imports["__init__.py"]


def test_table_rows_name_files_outside_parentheses():
    markdown = "\n".join(
        [
            "intro",
            TABLE_HEADER,
            "| --- | --- | --- |",
            "| top | `fsdp_compose/api/fully_shard.py` (`fully_shard`, see `wrap.py`), `_runtime/x.py`; beside it, `compat/` | all |",
            "| bottom | `api/policies.py` (`f(x)` data) | nothing |",
            "",
            "| not | `a.py` | part |",
        ]
    )
    assert parse_layers(markdown) == [
        Layer("top", ("api/fully_shard.py", "_runtime/x.py")),
        Layer("bottom", ("api/policies.py",)),
    ]


def test_problems_are_reported_by_file_and_layer():
    layers = [
        Layer("API", ("api/fully_shard.py", "gone.py")),
        Layer("runtime", ("_runtime/x.py", "_runtime/y.py", "api/fully_shard.py")),
        Layer("empty", ()),
    ]
    files = {"api/fully_shard.py", "_runtime/x.py", "_runtime/y.py", "_runtime/z.py"}
    imports = {"api/fully_shard.py": {"_runtime/x.py"}, "_runtime/x.py": {"_runtime/y.py"}, "_runtime/y.py": {"api/fully_shard.py"}}
    allowed = {("_runtime/x.py", "api/fully_shard.py"): "a stale entry"}
    assert_expected_inline(
        "\n".join(layering_problems(layers, files, imports, allowed)),
        """\
layer 'empty' names no file
fsdp_compose/api/fully_shard.py is in 2 places: 'API', 'runtime'
the table names fsdp_compose/gone.py (layer 'API'), which does not exist
fsdp_compose/_runtime/z.py is in no layer
fsdp_compose/_runtime/y.py (layer 'runtime') imports fsdp_compose/api/fully_shard.py (layer 'API')
ALLOWED_UPWARD lists fsdp_compose/_runtime/x.py -> fsdp_compose/api/fully_shard.py, which is no upward import""",
    )


# ----- the extras read facts, not runtime objects (issues 49, 54) -----------------------------------------
# A group reaches the extras as an ``extras_api.GroupHandle``, which shows nothing of it: its one field is private,
# and ``extras_api``'s own names have a leading underscore. So one rule keeps the port: the extras use nothing
# private of it (no ``._state`` read, on a handle or anything else, and no underscored name of ``extras_api``).
PORT_PRIVATE_FIELD = "_state"


def port_private_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, what)`` for each read of ``._state`` and each underscored name taken from ``extras_api``
    (imported from it, or read as ``extras_api._name``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == PORT_PRIVATE_FIELD:
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "extras_api":
            if node.attr.startswith("_"):
                found.append((node.lineno, f"extras_api.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == "extras_api":
            found += [(node.lineno, f"extras_api.{a.name}") for a in node.names if a.name.startswith("_")]
    return sorted(found)


def _extras_files() -> list[Path]:
    """The extras that could hold a handle: ``optim/`` takes only ``row_layout`` (checked below)."""
    inside = sorted((PACKAGE / "extras").rglob("*.py"))
    return inside + [p for root in EXTRA_PACKAGES for p in sorted(root.rglob("*.py"))]


def test_optim_takes_only_the_row_geometry_of_the_core():
    imports, taken = package_imports(), set()
    for path in sorted((PACKAGE / "optim").glob("*.py")):
        file = path.relative_to(PACKAGE).as_posix()
        assert {f for f in imports[file] if not f.startswith("optim/")} <= {EXTRAS_API}, file
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("extras_api"):
                taken |= {alias.name for alias in node.names}
    assert taken == {"row_layout"}


def test_extras_use_nothing_private_of_the_port():
    uses = [
        f"{path.relative_to(REPO)}:{line}: {what}"
        for path in _extras_files()
        for line, what in port_private_uses(ast.parse(path.read_text()))
    ]
    assert uses == [], "extras use what extras_api keeps private; read extras_api.group_facts instead:\n" + "\n".join(uses)


def test_port_private_uses_are_found():
    tree = ast.parse(
        "h._state.phase\nself._state\nfacts.params\nfrom ..extras_api import group_facts, _handle\n"
        "from fsdp_compose import extras_api\nextras_api._handles\nextras_api.group_of(m)\nself._ranks()\n"
    )
    assert_expected_inline(
        str(port_private_uses(tree)),
        """[(1, '._state'), (2, '._state'), (4, 'extras_api._handle'), (6, 'extras_api._handles')]""",
    )
