"""Print issue 23's size and coupling targets for ``fsdp_compose/``: each target, today's value, met or not.

    python tools/core_targets.py

Lines are counted as ``wc -l`` counts them (newline characters). "API plus runtime" is every
``fsdp_compose/*.py`` at the top level plus everything under ``fsdp_compose/runtime/``. The
pre-forward count runs a 2-block model on a 1-rank gloo group, takes one warm-up step, then
follows each block's forward pre-hook with ``sys.setprofile`` and counts the distinct files under
``fsdp_compose/`` whose Python frames start between the hook's entry and its return.
``tests/test_core_targets.py`` keeps these numbers from growing.

Issue 35's measures are printed too: code lines (lines holding code: no docstring, comment or
blank line) of API plus runtime and of the core (the package but ``extras/`` and ``optim/``; the
extras, ``fsdp_compose_shm/`` included, are counted apart), and the files under ``fsdp_compose/`` a
whole training step runs functions of, from the model's call to the end of ``loss.backward()``,
forward and backward apart (a 3-group model on a 1-rank gloo group, after a warm-up step), on three
paths (issue 49): fp32 ``Shard(0)``, bf16 mixed precision, and ``Shard(1)``.
"""

from __future__ import annotations

import ast
import functools
import io
import os
import sys
import threading
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fsdp_compose"

API_AND_RUNTIME_TARGET = 3500
CORE_LINES_TARGET = 5000
FILE_TARGET = 400
PRE_FORWARD_MODULES_TARGET = 8
FUNCTION_IMPORTS_TARGET = 0
# issue 35: code lines, and the files a whole step's forward and backward run through (issue 49: on three
# paths, and the 2,650 ceiling retired for 2,800: what stood between was features that belong in the core)
API_AND_RUNTIME_CODE_TARGET = 2800
CORE_CODE_TARGET = 3300
STEP_FILES_TARGET = 7


def line_count(path: Path) -> int:
    """Lines of ``path`` as ``wc -l`` counts them: its newline characters."""
    return path.read_bytes().count(b"\n")


def package_files(package: Path = PACKAGE) -> list[Path]:
    return sorted(package.rglob("*.py"))


EXTRA_FOLDERS = ("extras", "optim")  # the extras ring inside the package (docs/architecture.md, "Rings")
EXTRA_PACKAGES = (ROOT / "fsdp_compose_shm",)  # and beside it


def core_files(package: Path = PACKAGE) -> list[Path]:
    """The core: the package but its extras (issue 35's "core as a whole")."""
    return [f for f in package_files(package) if f.relative_to(package).parts[0] not in EXTRA_FOLDERS]


def extras_files(package: Path = PACKAGE) -> list[Path]:
    """The extras, counted apart from the core."""
    inside = [f for f in package_files(package) if f.relative_to(package).parts[0] in EXTRA_FOLDERS]
    return inside + [f for root in EXTRA_PACKAGES for f in sorted(root.rglob("*.py"))]


def api_and_runtime_files(package: Path = PACKAGE) -> list[Path]:
    return sorted(package.glob("*.py")) + sorted((package / "runtime").rglob("*.py"))


def total_lines(files: list[Path]) -> int:
    return sum(line_count(f) for f in files)


def code_lines(path: Path) -> int:
    """Lines of ``path`` that hold code: no blank line, comment or docstring (issue 35's measure)."""
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


def total_code_lines(files: list[Path]) -> int:
    return sum(code_lines(f) for f in files)


def files_over(limit: int, package: Path = PACKAGE) -> dict[str, int]:
    """Files of the package longer than ``limit`` lines, by path relative to the repository."""
    counts = {str(f.relative_to(package.parent)): line_count(f) for f in package_files(package)}
    return {name: n for name, n in counts.items() if n > limit}


def function_level_imports(package: Path = PACKAGE, own_only: bool = True) -> list[str]:
    """``import`` statements inside a function or class body, as ``path:line: statement``.

    Imports under a module-level ``if``/``try`` count as top level: they run at import time. With
    ``own_only`` only imports of the package's own modules count: only those can hide an import
    cycle (issue 23's target); a lazy import of an optional or heavy library (cloudpickle, dynamo)
    cannot.
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
                    where = f"{path.relative_to(package.parent)}:{node.lineno}"
                    found.append(f"{where}: {ast.unparse(node)}")
    return sorted(set(found), key=lambda s: (s.split(":")[0], int(s.split(":")[1])))


def _own(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").startswith("fsdp_compose")
    return any(alias.name.startswith("fsdp_compose") for alias in node.names)


def _hook_functions(hook: object) -> list:
    """A registered hook and the functions it wraps, through ``functools.partial`` and ``__wrapped__``."""
    functions = []
    while True:
        if isinstance(hook, functools.partial):
            hook = hook.func
            continue
        if hasattr(hook, "__code__"):
            functions.append(hook)
        if not hasattr(hook, "__wrapped__"):
            return functions
        hook = hook.__wrapped__


def _three_groups_unsharded():
    """The measured model: two blocks between two layers (with the root, three groups once sharded)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.Sequential(nn.Linear(16, 16), nn.ReLU()),
        nn.Sequential(nn.Linear(16, 16), nn.ReLU()),
        nn.Linear(16, 4),
    )


def pre_forward_modules() -> dict[str, list[str]]:
    """Files under ``fsdp_compose/`` whose code runs in each block's forward pre-hook, by block name.

    Needs an initialized default process group (any size; issue 23 measures 1 rank of gloo). The
    hook's entry is the registered pre-hook or the function named ``pre_forward`` in the module
    that defines it (which the sharded call's fast path calls directly, without the hook).
    """
    import torch

    from fsdp_compose import fully_shard

    model = _three_groups_unsharded()
    blocks = {"1": model[1], "2": model[2]}
    for block in blocks.values():
        fully_shard(block)
    fully_shard(model)

    functions = [f for hook in model[1]._forward_pre_hooks.values() for f in _hook_functions(hook)]
    for defining in {sys.modules[f.__module__] for f in functions}:
        if callable(getattr(defining, "pre_forward", None)):
            functions += _hook_functions(defining.pre_forward)
    entries = {f.__code__ for f in functions}
    package_dir = str(PACKAGE) + os.sep
    block_ids = {id(b): name for name, b in blocks.items()}
    touched: dict[str, set[str]] = {name: set() for name in blocks}
    current: list = []  # [entry frame, block name] while inside a block's pre-hook

    def profile(frame, event, arg):
        if event == "call":
            if not current and frame.f_code in entries:
                name = next((block_ids[id(v)] for v in frame.f_locals.values() if id(v) in block_ids), None)
                if name is not None:
                    current[:] = [frame, name]
            if current and frame.f_code.co_filename.startswith(package_dir):
                touched[current[1]].add(frame.f_code.co_filename)
        elif event == "return" and current and frame is current[0]:
            current.clear()

    x = torch.randn(4, 8)
    model(x).sum().backward()  # warm-up: lazy init, recorded order
    sys.setprofile(profile)
    try:
        loss = model(x).sum()
    finally:
        sys.setprofile(None)
    loss.backward()
    return {name: sorted(str(Path(f).relative_to(PACKAGE.parent)) for f in files) for name, files in touched.items()}


STEP_PATHS = ("plain", "bf16", "shard1")  # issue 49: fp32 Shard(0), bf16 mixed precision, Shard(1)


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


def step_files(path: str = "plain") -> dict[str, list[str]]:
    """Files under ``fsdp_compose/`` whose functions run in a whole step's forward (from the model's call)
    and in its backward (``loss.backward()``), after a warm-up step, on one of ``STEP_PATHS``. Needs a
    default process group."""
    import torch

    from fsdp_compose import fully_shard

    model = _three_groups_unsharded()
    options = _sharding_options(path)
    fully_shard(model[1], **options)
    fully_shard(model[2], **options)
    fully_shard(model, **options)
    package_dir = str(PACKAGE) + os.sep
    seen: dict[str, set[str]] = {"forward": set(), "backward": set()}
    phase = ["forward"]

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package_dir):
            seen[phase[0]].add(frame.f_code.co_filename)

    x = torch.randn(4, 8)
    model(x).sum().backward()  # warm-up: lazy init, recorded order
    threading.setprofile(profile)  # autograd may run backward on a thread of its own
    sys.setprofile(profile)
    try:
        loss = model(x).sum()
        phase[0] = "backward"
        loss.backward()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return {name: sorted(str(Path(f).relative_to(PACKAGE.parent)) for f in files) for name, files in seen.items()}


def pre_forward_module_count(by_block: dict[str, list[str]]) -> int:
    """The most modules any one block's pre-hook touched."""
    return max(len(files) for files in by_block.values())


@dataclass
class Target:
    name: str
    target: int
    value: int

    def line(self) -> str:
        met = "met" if self.value <= self.target else "not met"
        return f"{self.name:<40} target <= {self.target:<6} value {self.value:<6} {met}"


def measure_in_process() -> tuple[dict[str, list[str]], dict[str, dict[str, list[str]]]]:
    """``pre_forward_modules``, and ``step_files`` on every path, on a fresh 1-rank gloo group in this process."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return pre_forward_modules(), {path: step_files(path) for path in STEP_PATHS}
    finally:
        dist.destroy_process_group()


def main() -> None:
    sys.path.insert(0, str(ROOT))
    over = files_over(FILE_TARGET)
    imports = function_level_imports()
    by_block, by_path = measure_in_process()
    api_runtime_code = total_code_lines(api_and_runtime_files())
    targets = [
        Target("code lines: API + runtime/ (issue 49)", API_AND_RUNTIME_CODE_TARGET, api_runtime_code),
        Target("code lines: the core (issue 35)", CORE_CODE_TARGET, total_code_lines(core_files())),
        *(
            Target(f"files a {path} step's {phase} runs", STEP_FILES_TARGET, len(files))
            for path, by_phase in by_path.items()
            for phase, files in by_phase.items()
        ),
        Target("lines: API + runtime/", API_AND_RUNTIME_TARGET, total_lines(api_and_runtime_files())),
        Target("lines: the core", CORE_LINES_TARGET, total_lines(core_files())),
        Target(f"files over {FILE_TARGET} lines", 0, len(over)),
        Target("modules one block pre-hook touches", PRE_FORWARD_MODULES_TARGET, pre_forward_module_count(by_block)),
        Target("function-level imports of our modules", FUNCTION_IMPORTS_TARGET, len(imports)),
    ]
    for t in targets:
        print(t.line())
    extras = extras_files()
    print(
        f"extras, counted apart ({', '.join(f + '/' for f in EXTRA_FOLDERS)} of fsdp_compose/, "
        f"{', '.join(p.name + '/' for p in EXTRA_PACKAGES)}): {total_lines(extras)} lines, "
        f"{total_code_lines(extras)} code lines"
    )
    print(f"\nfiles over {FILE_TARGET} lines:")
    for name, n in sorted(over.items(), key=lambda kv: -kv[1]):
        print(f"  {n:5d} {name}")
    for block, files in by_block.items():
        print(f"\nblock {block}'s forward pre-hook touches {len(files)} modules:")
        for f in files:
            print(f"  {f}")
    for path, by_phase in by_path.items():
        for phase, files in by_phase.items():
            print(f"\na whole {path} step's {phase} runs functions of {len(files)} files:")
            for f in files:
                print(f"  {f}")
    print("\nfunction-level imports of our modules (each may hide a cycle):")
    for imp in imports:
        print(f"  {imp}")
    print("\nlazy imports of other libraries (not counted):")
    for imp in sorted(set(function_level_imports(own_only=False)) - set(imports)):
        print(f"  {imp}")


if __name__ == "__main__":
    main()
