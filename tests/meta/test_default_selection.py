"""The default run keeps a case of every test README.md cites; the slow marker is what leaves tests out.

README.md's test command (``python -m pytest -q``) leaves out the tests marked ``slow`` (pyproject.toml's
``addopts``); ``.ci/run`` runs them on every torch release. The README names a test for each feature it
claims, so the rule checked here is: every test README.md names (``tests/x.py::test_name``, or
``::test_name`` after a named file) has at least one case (parametrization) in the default selection,
and every test file it names alone has at least one test there. The selection is pytest's own: the
marks pytest collected for the cited files in this session (when it collected them whole), or the
cited files collected in a fresh process with the project's settings, as the README's command does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.harness import hang_timeout

REPO = Path(__file__).resolve().parents[2]
# a cited file (tests/x.py), a cited test in it (tests/x.py::name), or ``::name`` in the last file cited
CITATION = re.compile(r"(tests/[\w/]+\.py)(?:::(\w+))?|`::(\w+)`")


def readme_citations() -> list[tuple[str, str | None]]:
    """``(file, test name or None)`` for each test README.md cites, in order."""
    cited, last_file = [], None
    for m in CITATION.finditer((REPO / "README.md").read_text()):
        path, name, continued = m.groups()
        if path is None:
            assert last_file is not None, f"`::{continued}` before any cited file"
            cited.append((last_file, continued))
            continue
        last_file = path
        if Path(path).name.startswith("test_"):  # tests/harness.py is cited as the harness, not as tests
            cited.append((path, name))
    return cited


def default_selection(files: list[str], collected: list) -> list[str]:
    """Node ids of ``files`` that ``python -m pytest -q`` runs: from this session's collection when it
    collected the whole suite (the marks decide, as ``-m 'not slow'`` does), else collected afresh."""
    here = [item for item in collected if item.nodeid.split("::")[0] in files]
    if {item.nodeid.split("::")[0] for item in here} == set(files):
        return [item.nodeid for item in here if item.get_closest_marker("slow") is None]
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=hang_timeout(),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_the_default_run_leaves_out_the_slow_marker_only():
    """The one mechanism: ``addopts`` deselects ``slow`` (``-m slow`` runs only those, ``-m ''`` all)."""
    options = (REPO / "pyproject.toml").read_text().split("[tool.pytest.ini_options]")[1].split("\n[")[0]
    assert re.findall(r"^addopts = (.*)$", options, re.M) == ["\"-m 'not slow'\""], options
    assert re.search(r'^    "slow: ', options, re.M), options


def test_every_test_the_readme_cites_has_a_case_in_the_default_run(collected_items):
    cited = readme_citations()
    assert len(cited) >= 30, cited  # the feature table and the prose name several dozen
    nodes = default_selection(sorted({path for path, _ in cited}), collected_items)
    selected = {(node.split("::")[0], re.sub(r"\[.*", "", node.split("::")[-1])) for node in nodes}
    files = {path for path, _ in selected}
    missing = [
        f"{path}::{name}" if name else f"{path} (no test of the file)"
        for path, name in cited
        if ((path, name) not in selected if name else path not in files)
    ]
    assert not missing, "cited in README.md but only in the slow run (or not at all):\n" + "\n".join(missing)
