"""fsdp_compose behaves like a library: its errors are public names that print and pickle as
``fsdp_compose.<Name>``, it has a ``__version__``, reports information through ``logging`` (silent unless
the program configures logging) and imports without a warning."""

import importlib
import inspect
import logging
import pickle
import pkgutil
import re
import subprocess
import sys
import traceback
from pathlib import Path

import fsdp_compose

ROOT = Path(__file__).resolve().parents[2]

# Raised by the library but caught as their exported base; each with the reason it is not a public name
INTERNAL = {
    "FileRefused": "the checkpoint file layer's refusal; a CheckpointError, raised as one",
}
# constructor arguments where a message alone does not do
ARGUMENTS = {"FileRefused": ("some/file", "a reason")}


def _exception_classes() -> dict[str, type]:
    """Every exception class defined in fsdp_compose's modules (all of them imported), by name."""
    found = {}
    for info in pkgutil.walk_packages(fsdp_compose.__path__, "fsdp_compose."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            # an underscored class is private control flow, caught inside its module (``files._Duplicate``)
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__.startswith("fsdp_compose"):
                if not name.startswith("_"):
                    found[name] = value
    return found


def test_every_exception_is_a_public_name_of_fsdp_compose():
    classes = _exception_classes()
    assert {"ExecutionOrderError", "CollectiveError", "MeshRoleError", "AlreadyShardedError", "CheckpointError",
            "PretrainedCheckpointError"} <= set(classes)
    problems = []
    for name, cls in sorted(classes.items()):
        if name in INTERNAL:
            if not any(base.__module__ == "fsdp_compose" for base in cls.__mro__[1:]):
                problems.append(f"{name}: internal, but no exported base class to catch it by")
            continue
        if name not in fsdp_compose.__all__ or getattr(fsdp_compose, name) is not cls:
            problems.append(f"{name}: not exported from fsdp_compose (__all__)")
        if cls.__module__ != "fsdp_compose":
            problems.append(f"{name}: __module__ is {cls.__module__!r}; set __module__ = 'fsdp_compose'")
    assert not problems, "\n".join(problems)


def test_errors_print_their_public_path_and_pickle():
    for name, cls in sorted(_exception_classes().items()):
        error = cls(*ARGUMENTS.get(name, ("a message",)))
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is cls and str(again) == str(error), name
        if name not in INTERNAL:
            assert traceback.format_exception_only(error)[-1].startswith(f"fsdp_compose.{name}: "), name


def test_import_is_silent_and_errors_unpickle_in_a_fresh_process():
    """A rank's exception arrives in a process that has not imported fsdp_compose (or its extras) yet: pickle
    imports them, under ``-W error`` and with nothing on stderr, as ``python -W error -c "import fsdp_compose"``
    would (one interpreter start for both checks)."""
    classes = {name: cls for name, cls in _exception_classes().items() if name not in INTERNAL}
    blob = pickle.dumps([cls("from a rank") for cls in classes.values()])
    check = (
        "import pickle, sys\n"
        "assert 'fsdp_compose' not in sys.modules\n"
        "errors = pickle.loads(sys.stdin.buffer.read())\n"
        "print(' '.join(f'{type(e).__module__}.{type(e).__name__}' for e in errors))\n"
    )
    done = subprocess.run([sys.executable, "-W", "error", "-c", check], input=blob, capture_output=True, cwd=ROOT)
    assert done.returncode == 0 and not done.stderr, done.stderr.decode()
    assert done.stdout.decode().split() == [f"fsdp_compose.{name}" for name in classes]


def test_version_is_the_one_pyproject_reads():
    assert re.fullmatch(r"\d+\.\d+\.\d+", fsdp_compose.__version__)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'version = { attr = "fsdp_compose.__version__" }' in pyproject


def test_the_package_logger_is_silent_until_configured_and_each_module_logs_under_it():
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("fsdp_compose").handlers)
    named = {}
    for info in pkgutil.walk_packages(fsdp_compose.__path__, "fsdp_compose."):
        logger = getattr(importlib.import_module(info.name), "logger", None)
        if logger is not None:
            named[info.name] = logger.name
    assert len(named) >= 5 and all(name == module for module, name in named.items()), named


def test_fully_shard_names_shard_placement_result():
    """Its type hint and docstring say what ``shard_placement_fn`` may return, ShardPlacementResult included."""
    hint = str(inspect.signature(fsdp_compose.fully_shard).parameters["shard_placement_fn"].annotation)
    assert "ShardPlacementResult" in hint and "ShardPlacementResult(placement, mesh_info)" in fsdp_compose.fully_shard.__doc__
