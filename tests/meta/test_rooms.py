"""The structure rules ``tools/rooms.py`` prints: no file over 400 lines, no function-level import of our own
modules (it could hide an import cycle), and at most 2 returns to the group's file on the backward reduction path.
Code lines are printed per room for the reader, never held to a ceiling."""

import subprocess

from tests.harness import run_on_ranks
from tools import rooms


def test_no_file_over_400_lines():
    assert rooms.files_over(rooms.FILE_LIMIT) == {}


def test_no_function_level_import_of_our_modules():
    imports = rooms.function_level_imports()
    assert imports == [], "\n".join(imports)


def test_line_count_matches_wc():
    files = rooms.package_files()
    wc = subprocess.run(["wc", "-l", *map(str, files)], capture_output=True, text=True, check=True).stdout
    assert int(wc.splitlines()[-1].split()[0]) == sum(rooms.line_count(f) for f in files)


def test_code_lines_skip_docstrings_comments_and_blanks(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('"""Module\n\ndocstring."""\n\n# a comment\nx = (\n    1,  # trailing\n)\n\n\ndef f():\n    """Doc."""\n    return x\n')
    assert rooms.code_lines(sample) == 5  # x = ( / 1, / ) / def f(): / return x


def test_every_room_is_counted():
    counted = rooms.room_code_lines()
    assert {"(root)", "api/", "_runtime/", "_checks/", "_torch_workarounds/", "whole_model/", "extras/", "optim/"} <= set(counted)
    assert sum(files for files, _ in counted.values()) == len(rooms.package_files()) + sum(
        len(list(root.rglob("*.py"))) for root in rooms.EXTRA_PACKAGES
    )


def _reduction_returns():
    return {path: rooms.reduction_returns(path) for path in rooms.STEP_PATHS}


def test_the_backward_reduction_path_returns_to_the_group_file_at_most_twice():
    """On the plain, bf16 mixed-precision and Shard(1) paths alike."""
    by_path = run_on_ranks(1, _reduction_returns)[0]
    assert set(by_path) == set(rooms.STEP_PATHS)
    for path, returns in by_path.items():
        assert returns.get(rooms.GROUP_FILE, 0) <= rooms.GROUP_FILE_RETURNS_LIMIT, (path, returns)

