"""bench/results.py: docs/results.md is generated from bench/results/<benchmark>/README.md, and
--check fails when the page is stale or a folder breaks the format (scripts/test.sh runs it on
the repository; these tests run it on a copy, where the folders can be broken)."""
import os
import re
import shutil
import subprocess
import sys

import pytest

# The repository: MOONBRIGHT_TEST_REPO where scripts/test.sh runs a copy of the tests outside it,
# else the one these tests are in.
ROOT = os.environ.get("MOONBRIGHT_TEST_REPO") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)


@pytest.fixture
def tree(tmp_path):
    """A copy of the script, the result folders and the page, laid out as in the repository."""
    os.makedirs(tmp_path / "bench")
    os.makedirs(tmp_path / "docs")
    shutil.copy(os.path.join(ROOT, "bench", "results.py"), tmp_path / "bench")
    shutil.copytree(os.path.join(ROOT, "bench", "results"), tmp_path / "bench" / "results")
    shutil.copy(os.path.join(ROOT, "docs", "results.md"), tmp_path / "docs")
    return tmp_path


def run(tree, *args):
    return subprocess.run([sys.executable, str(tree / "bench" / "results.py"), *args],
                          capture_output=True, text=True)


def test_the_committed_page_is_current(tree):
    r = run(tree, "--check")
    assert r.returncode == 0, r.stderr


def test_an_edited_figure_makes_the_page_stale_until_regenerated(tree):
    readme = tree / "bench" / "results" / "stress" / "README.md"
    text = readme.read_text()
    figure = re.search(r"\| \*\*(\d+\.\d+)\*\* \|", text)
    assert figure, "the stress folder's figures should have a bold figure in a table cell"
    edited = "| **9.999** |"
    readme.write_text(text.replace(figure.group(0), edited, 1))
    r = run(tree, "--check")
    assert r.returncode == 1 and "stale" in r.stderr, r.stderr
    assert run(tree).returncode == 0
    assert edited in (tree / "docs" / "results.md").read_text()
    assert run(tree, "--check").returncode == 0


def test_a_new_folder_is_picked_up(tree):
    new = tree / "bench" / "results" / "zz-new"
    os.makedirs(new)
    (new / "README.md").write_text(
        "# A new benchmark\n\nWhat it measures.\n\n- card: NVIDIA H200\n- driver: 580\n"
        "- torch: -\n- commit: abc1234\n- date: 2026-12-06\n- command: `true`\n\n"
        "## Figures\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n## Files\n\n- none\n")
    assert run(tree, "--check").returncode == 1
    assert run(tree).returncode == 0
    page = (tree / "docs" / "results.md").read_text()
    assert "## A new benchmark" in page and "`bench/results/zz-new/`" in page


def test_a_folder_without_provenance_or_with_code_is_refused(tree):
    readme = tree / "bench" / "results" / "scale" / "README.md"
    readme.write_text(readme.read_text().replace("- commit: b021869\n", ""))
    r = run(tree, "--check")
    assert r.returncode == 1 and "lacks commit" in r.stderr, r.stderr
    shutil.copy(os.path.join(ROOT, "docs", "results.md"), tree / "docs")
    readme.write_text(open(os.path.join(ROOT, "bench", "results", "scale", "README.md")).read())
    (tree / "bench" / "results" / "scale" / "run.sh").write_text("echo\n")
    r = run(tree, "--check")
    assert r.returncode == 1 and "code kept in results" in r.stderr, r.stderr
