"""Print the package's rooms with their code lines, and the structure rules ``tests/meta/test_rooms.py`` keeps.

    python -m tools.rooms

A room is a folder of ``fsdp_compose/`` (docs/architecture.md, "Rooms"); the files at the package root form one
room of their own. Code lines are lines holding code: no docstring, comment or blank line. The figures are printed
for the reader, not held to a ceiling: what the tests keep is structure (no file over 400 lines, no function-level
import of our own modules, and few returns on the backward reduction path, below).

**Returns on the backward reduction path.** A one-group model trains a warm-up step on a 1-rank gloo group, then
its next backward is followed with ``sys.setprofile`` from the first ``ParamGroup.start_reduce`` to the end of
``loss.backward()``. A *return* to a file is a call into it, while no frame of it is on the stack, from another
caller file than the one that entered it last: control coming back to a file the path already left, from elsewhere,
which a reader has to follow. A file calling its own helpers, a callee returning to its caller, or a loop calling the
same helper per parameter is no return. Counted on three paths: fp32 ``Shard(0)``, bf16 mixed precision and
``Shard(1)``.
"""

from __future__ import annotations

import ast
import io
import os
import sys
import threading
import tokenize
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fsdp_compose"
FILE_LIMIT = 400
GROUP_FILE = "fsdp_compose/_runtime/group.py"
GROUP_FILE_RETURNS_LIMIT = 2
EXTRA_PACKAGES = (ROOT / "fsdp_compose_shm", ROOT / "fsdp_compose_compat")  # beside the package, counted apart
STEP_PATHS = ("plain", "bf16", "shard1")


def line_count(path: Path) -> int:
    """Lines of ``path`` as ``wc -l`` counts them: its newline characters."""
    return path.read_bytes().count(b"\n")


def package_files(package: Path = PACKAGE) -> list[Path]:
    return sorted(package.rglob("*.py"))


def code_lines(path: Path) -> int:
    """Lines of ``path`` that hold code: no blank line, comment or docstring."""
    source = path.read_text()
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def room_of(path: Path, package: Path = PACKAGE) -> str:
    """The room of a package file: its top folder under ``fsdp_compose/``, or ``(root)`` for the root's files."""
    parts = path.relative_to(package).parts
    return parts[0] + "/" if len(parts) > 1 else "(root)"


def room_code_lines(package: Path = PACKAGE) -> dict[str, tuple[int, int]]:
    """Room -> (files, code lines), the packages beside ``fsdp_compose/`` included under their own names."""
    rooms: dict[str, list[int]] = {}
    for path in package_files(package):
        counts = rooms.setdefault(room_of(path, package), [0, 0])
        counts[0] += 1
        counts[1] += code_lines(path)
    for root in EXTRA_PACKAGES:
        files = sorted(root.rglob("*.py"))
        rooms[root.name + "/"] = [len(files), sum(code_lines(f) for f in files)]
    return {room: (n, lines) for room, (n, lines) in rooms.items()}


def files_over(limit: int, package: Path = PACKAGE) -> dict[str, int]:
    """Files of the package longer than ``limit`` lines, by path relative to the repository."""
    counts = {str(f.relative_to(package.parent)): line_count(f) for f in package_files(package)}
    return {name: n for name, n in counts.items() if n > limit}


def function_level_imports(package: Path = PACKAGE, own_only: bool = True) -> list[str]:
    """``import`` statements inside a function or class body, as ``path:line: statement``.

    Imports under a module-level ``if``/``try`` count as top level: they run at import time. With ``own_only`` only
    imports of the package's own modules count: only those can hide an import cycle; a lazy import of an optional or
    heavy library (cloudpickle, dynamo) cannot.
    """
    found = []
    for path in package_files(package):
        tree = ast.parse(path.read_text(), filename=str(path))
        nested_in = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
        for scope in ast.walk(tree):
            if not isinstance(scope, nested_in):
                continue
            for node in ast.walk(scope):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and (not own_only or _own(node)):
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno}: {ast.unparse(node)}")
    return sorted(set(found), key=lambda s: (s.split(":")[0], int(s.split(":")[1])))


def _own(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").startswith("fsdp_compose")
    return any(alias.name.startswith("fsdp_compose") for alias in node.names)


def _sharding_options(path: str) -> dict:
    """``fully_shard``'s options for one of ``STEP_PATHS``."""
    import torch
    from torch.distributed.tensor import Shard

    from fsdp_compose import MixedPrecisionPolicy

    if path == "bf16":
        return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}
    if path == "shard1":
        return {"shard_placement_fn": lambda p: Shard(1) if p.ndim == 2 else None}
    return {}


def reduction_returns(path: str = "plain") -> dict[str, int]:
    """File -> returns to it on a one-group model's backward reduction path (see the module docstring), on one of
    ``STEP_PATHS``. Needs a default process group."""
    import torch
    from torch import nn

    from fsdp_compose import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fully_shard(model, **_sharding_options(path))
    package_dir = str(PACKAGE) + os.sep
    entered_from: dict[str, str] = {}  # file -> the caller's file when the path last entered it
    returns: Counter[str] = Counter()
    started = [False]

    def on_stack(frame, filename: str) -> bool:
        caller = frame.f_back
        while caller is not None:
            if caller.f_code.co_filename == filename:
                return True
            caller = caller.f_back
        return False

    def profile(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(package_dir):
            return
        filename = frame.f_code.co_filename
        if not started[0]:
            if frame.f_code.co_name != "start_reduce":
                return
            started[0] = True
        caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
        if caller == filename or on_stack(frame, filename):
            return
        if filename in entered_from and entered_from[filename] != caller:
            returns[str(Path(filename).relative_to(PACKAGE.parent))] += 1
        entered_from[filename] = caller

    x = torch.randn(4, 8)
    model(x).sum().backward()  # warm-up: lazy init, recorded order
    loss = model(x).sum()
    threading.setprofile(profile)  # autograd may run backward on a thread of its own
    sys.setprofile(profile)
    try:
        loss.backward()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert started[0], "the backward never reached ParamGroup.start_reduce"
    return dict(returns)


def measure_in_process() -> dict[str, dict[str, int]]:
    """``reduction_returns`` on every path, on a fresh 1-rank gloo group in this process."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return {path: reduction_returns(path) for path in STEP_PATHS}
    finally:
        dist.destroy_process_group()


def main() -> None:
    sys.path.insert(0, str(ROOT))
    print("room                      files  code lines")
    for room, (files, lines) in sorted(room_code_lines().items()):
        print(f"  {room:<24}{files:>5}  {lines:>10}")
    over = files_over(FILE_LIMIT)
    print(f"\nfiles over {FILE_LIMIT} lines: {len(over)}")
    for name, n in sorted(over.items(), key=lambda kv: -kv[1]):
        print(f"  {n:5d} {name}")
    imports = function_level_imports()
    print(f"\nfunction-level imports of our modules (each may hide a cycle): {len(imports)}")
    for imp in imports:
        print(f"  {imp}")
    for path, returns in measure_in_process().items():
        print(f"\nreturns on the {path} backward reduction path (at most {GROUP_FILE_RETURNS_LIMIT} to {GROUP_FILE}):")
        for name, count in sorted(returns.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"  {count:3d} {name}")


if __name__ == "__main__":
    main()
