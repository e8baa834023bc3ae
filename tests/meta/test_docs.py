"""Every ```python block in README.md and docs/*.md runs as written.

The convention (also stated in docs/index.md): a page's python blocks run in order as one
script on 2 gloo ranks, launched like torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT set), so the first block does its own imports and ``init_process_group``. A block
preceded, on the line just above its fence, by ``<!-- docs-test: skip (reason) -->`` is not
run, and a page holding ``<!-- docs-test: requires transformers accelerate -->`` is skipped
unless those modules import (optional extras). The script keeps each block on its page's line
numbers, so a traceback's line is the line in the page. Inside the ranks every warning is an error
(``warnings.simplefilter("error")``, and ``PYTHONWARNINGS=error`` for processes a page starts): a doc
example that warns fails its page, so the examples show the API a user should call. Pages run two at a time (the next page starts while this one is checked);
each has a hard deadline after which both ranks are killed. Ranks fork from a server that has
torch and fsdp_compose imported, so a page costs its own work, not two interpreter start-ups.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import re
import runpy
import signal
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore

from tests.harness import hang_timeout

REPO = Path(__file__).resolve().parents[2]
WORLD_SIZE = 2
PAGE_TIMEOUT_S = hang_timeout()  # a hang detector: pages run two at a time, on a loaded machine too
REQUIRES_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*requires\s+([\w. ]+?)\s*-->\s*$", re.M)
SKIP_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*skip\s*\((.+)\)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*(\S*)")


def doc_pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def page_script(text: str) -> tuple[str, int, int]:
    """The page's runnable python blocks as one script with the page's line numbers.

    Returns (script, blocks run, blocks skipped)."""
    lines = text.splitlines()
    out = [""] * len(lines)
    ran = skipped = 0
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        if lang == "python":
            if i > 0 and SKIP_MARKER.match(lines[i - 1]):
                skipped += 1
            else:
                ran += 1
                for k in range(i + 1, j):
                    line = lines[k]
                    out[k] = line[len(indent) :] if line.startswith(indent) else line.lstrip()
        i = j + 1
    return "\n".join(out) + "\n", ran, skipped


def test_page_script_keeps_line_numbers_and_honours_skip() -> None:
    text = "# t\n```python\nx = 1\n```\n<!-- docs-test: skip (needs 8 ranks) -->\n```python\nboom\n```\n```bash\nls\n```\n```python\ny = x\n```\n"
    script, ran, skipped = page_script(text)
    assert (ran, skipped) == (2, 1)
    assert script.splitlines()[2] == "x = 1" and script.splitlines()[12] == "y = x"
    assert "boom" not in script and "ls" not in script


LINK = re.compile(r"\]\(([^)\s]+)\)")
# pages other branches add, linked from the guide index before they merge; once a page exists
# the normal check applies, so this set can be emptied after the merge
PAGES_FROM_OTHER_BRANCHES: set[str] = set()


def test_links_stay_in_the_repository() -> None:
    """Every markdown link is relative and names a file of this repository."""
    bad = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            path = target.split("#", 1)[0]
            if "://" in target or target.startswith(("/", "mailto:")):
                bad.append(f"{page.relative_to(REPO)}: {target} leaves the repository")
            elif path and not (page.parent / path).resolve().is_relative_to(REPO):
                bad.append(f"{page.relative_to(REPO)}: {target} leaves the repository")
            elif path and not (page.parent / path).exists():
                if str((page.parent / path).resolve().relative_to(REPO)) in PAGES_FROM_OTHER_BRANCHES:
                    continue
                bad.append(f"{page.relative_to(REPO)}: {target} does not exist")
    assert not bad, "\n".join(bad)


def _run_rank(script: str, workdir: str, log: str, env: dict[str, str]) -> None:
    """One rank of a page, in a child of the forkserver (torch and fsdp_compose already imported)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    os.chdir(workdir)
    faulthandler.enable()  # a crash prints every thread's Python stack
    torch.set_num_threads(1)
    sys.argv = [script]
    sys.path.insert(0, workdir)
    warnings.simplefilter("error")  # a doc example that warns fails its page (-W error)
    # torch.compile's tracer reads .grad of non-leaf activations and hides the UserWarning that raises by
    # swapping warnings.showwarning (torch._logging.hide_warnings): a user never sees it, but the "error"
    # action raises before showwarning runs, so this one message, and only it, is let through
    warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf Tensor", category=UserWarning)
    runpy.run_path(script, run_name="__main__")


# Importing torch and fsdp_compose costs seconds per process; ranks fork from a server that has
# them imported (like a torchrun worker that starts fast), with the environment torchrun sets.
_forkserver = multiprocessing.get_context("forkserver")
_forkserver.set_forkserver_preload(["torch", "torch.distributed", "fsdp_compose"])


@dataclass
class PageRun:
    """Both ranks of one page's script."""

    page: Path
    workdir: Path
    procs: list = field(default_factory=list)
    started: float = 0.0
    store: object = None
    timeout: float = PAGE_TIMEOUT_S

    def start(self) -> None:
        script, _, _ = page_script(self.page.read_text())
        path = self.workdir / (self.page.name + ".py")
        path.write_text(script)
        # like torchrun, this process hosts the store and every rank is a client
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.started = time.monotonic()
        for rank in range(WORLD_SIZE):
            env = {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(WORLD_SIZE),
                "LOCAL_WORLD_SIZE": str(WORLD_SIZE),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(self.store.port),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "GLOO_SOCKET_IFNAME": "lo",
                "OMP_NUM_THREADS": "1",
                "PYTHONWARNINGS": "error",  # processes a page starts (mp.spawn, DataLoader workers) too
            }
            log = str(self.workdir / f"rank{rank}.log")
            # not daemonic: a page may start processes of its own (DataLoader workers, mp.spawn)
            proc = _forkserver.Process(target=_run_rank, args=(str(path), str(self.workdir), log, env))
            proc.start()
            self.procs.append(proc)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.exitcode is None:
                proc.kill()
            proc.join()

    def wait(self) -> tuple[list[int | None], bool]:
        """Exit codes per rank, and whether the deadline passed (then every rank is killed)."""
        deadline = self.started + self.timeout
        while time.monotonic() < deadline:
            codes = [p.exitcode for p in self.procs]
            if all(c is not None for c in codes):
                return codes, False
            if any(c not in (None, 0) for c in codes):  # a peer may be stuck in a collective
                deadline = min(deadline, time.monotonic() + 5)
            time.sleep(0.05)
        codes = [p.exitcode for p in self.procs]
        self.kill()
        return codes, any(c is None for c in codes)

    def logs(self) -> str:
        parts = []
        for rank in range(WORLD_SIZE):
            text = (self.workdir / f"rank{rank}.log").read_text()
            parts.append(f"--- rank {rank} output (last 4000 chars):\n{text[-4000:]}")
        return "\n".join(parts)


PAGES = doc_pages()
_runs: dict[Path, PageRun] = {}
_tmp = tempfile.TemporaryDirectory(prefix="fsdp_compose_docs_")


def _launch(page: Path) -> PageRun:
    if page not in _runs:
        workdir = Path(_tmp.name) / page.stem
        workdir.mkdir()
        _runs[page] = PageRun(page, workdir)
        _runs[page].start()
    return _runs[page]


@pytest.fixture(scope="module", autouse=True)
def _kill_leftovers():
    yield
    for run in _runs.values():
        run.kill()


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_page_runs(page: Path, request: pytest.FixtureRequest) -> None:
    text = page.read_text()
    _, ran, _ = page_script(text)
    if ran == 0:
        pytest.skip("no python blocks")
    for line in REQUIRES_MARKER.findall(text):  # optional extras, e.g. transformers for huggingface.md
        for module in line.split():
            pytest.importorskip(module)
    run = _launch(page)
    selected = {item.callspec.params["page"] for item in request.session.items if item.originalname == "test_page_runs"}
    for later in PAGES[PAGES.index(page) + 1 :]:  # start the next selected page while this one runs
        if later in selected and page_script(later.read_text())[1]:
            _launch(later)
            break
    codes, timed_out = run.wait()
    rel = page.relative_to(REPO)
    if timed_out and not any(codes):
        pytest.fail(f"{rel}: ranks still running after {PAGE_TIMEOUT_S:.0f}s (killed); exit codes {codes}\n{run.logs()}")
    if any(codes):
        pytest.fail(f"{rel}: exit codes {codes}, None: killed (traceback line numbers are the page's)\n{run.logs()}")


def test_readme_test_command_is_what_ci_runs() -> None:
    """.ci/run runs the README's test command, then the slow tests, then the whole suite (default and
    slow) on the torch releases the README names."""
    ci, readme = (REPO / ".ci" / "run").read_text(), (REPO / "README.md").read_text()
    lines = ci.splitlines()
    command = next(line for line in lines if line.startswith("pip install"))
    assert command in readme, command
    assert command.endswith("&& python -m pytest -q"), command  # the default selection, as the README runs it
    assert lines[lines.index(command) + 1] == "python -m pytest -q -m slow", lines
    versions = re.search(r"^for version in (.+); do$", ci, re.M).group(1).split()
    assert versions == ["2.11.0", "2.14.1"], versions
    assert """  bash tools/test_torch.sh "$version" -m ''""" in lines, lines  # everything, slow tests included
    assert "**Supported torch: 2.11.0 through 2.14.1**" in readme


def test_a_failing_block_names_its_page_line_and_a_hang_is_killed(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nimport os, time\nimport torch.distributed as dist\ndist.init_process_group('gloo')\n```\n"
        "text\n```python\nif dist.get_rank() == 1:\n    raise ValueError('boom')\ndist.barrier()\n```\n"
    )
    run = PageRun(page, tmp_path, timeout=hang_timeout())
    run.start()
    codes, _ = run.wait()
    assert codes[1] == 1, codes  # rank 0 errors out of the barrier or is killed 5 s later
    assert 'page.md.py", line 9' in run.logs() and "ValueError: boom" in run.logs()

    page.write_text("```python\nimport time\ntime.sleep(60)\n```\n")
    hang = tmp_path / "hang"
    hang.mkdir()
    run = PageRun(page, hang, timeout=2)
    run.start()
    codes, timed_out = run.wait()
    assert timed_out and codes == [None, None]
    assert all(p.exitcode == -signal.SIGKILL for p in run.procs)


def test_a_block_that_warns_fails_its_page(tmp_path: Path) -> None:
    """A warning in a doc example is an error in its ranks, so the page fails and names the warning."""
    page = tmp_path / "page.md"
    page.write_text("```python\nimport warnings\n\nwarnings.warn('x is deprecated', FutureWarning)\n```\n")
    run = PageRun(page, tmp_path, timeout=hang_timeout())
    run.start()
    codes, timed_out = run.wait()
    assert not timed_out and codes == [1, 1], codes
    assert 'page.md.py", line 4' in run.logs() and "FutureWarning: x is deprecated" in run.logs()


def test_every_cited_test_exists() -> None:
    """README.md and docs/ cite the tests behind their claims; each cited file and test must exist."""
    cited = sorted({m for page in doc_pages() for m in re.findall(r"tests/[\w/]+\.py(?:::\w+)?", page.read_text())})
    missing = []
    for ref in cited:
        path, _, name = ref.partition("::")
        if not (REPO / path).is_file():
            missing.append(ref)
        elif name and not re.search(rf"^\s*(?:async )?def {name}\b", (REPO / path).read_text(), re.M):
            missing.append(ref)
    assert cited and not missing, missing


def test_benchmarks_page_stays_a_page() -> None:
    """docs/benchmarks.md is what a user reads (results, how to rerun them), not a log: at most 300 lines."""
    lines = (REPO / "docs" / "benchmarks.md").read_text().splitlines()
    assert len(lines) <= 300, len(lines)
