"""The package layout keeps its promises: no import cycle and nothing in ``fsdp_compose/`` naming
torch's FSDP modules (the layering itself is checked by ``test_architecture.py``)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp_compose"


def _module_imports() -> dict[str, set[str]]:
    """Module-level relative imports of every module, as dotted names inside the package."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                submodules = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in names]
                # ``from . import sibling`` imports the sibling; its package is already being imported (implicit)
                imports_package = node.module is not None or len(submodules) < len(node.names)
                deps |= {t for t in ([target] if imports_package else []) + submodules if t in names}
        graph[name] = deps
    return graph


def test_no_import_cycle():
    graph, state, cycles = _module_imports(), {}, []

    def visit(name, stack):
        state[name] = "open"
        for dep in sorted(graph[name]):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, cycles


def test_package_never_names_torch_fsdp():
    hits = [
        f"{path.relative_to(PACKAGE.parent)}:{number}"
        for path in PACKAGE.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "torch.distributed.fsdp" in line or "_composable.fsdp" in line
    ]
    assert not hits, hits
