"""The documentation: the MkDocs site builds strictly, and the README's code runs.

The site (mkdocs.yml, docs/) is built with `mkdocs build --strict`: with the
`validation` settings of mkdocs.yml, a link to a missing page or anchor, or a
page left out of the nav, is a warning and fails the build. The README is not
part of the site (it sits at the repository's root, for GitHub and PyPI), so
its links are checked here, and its ```python blocks are run, each in a fresh
interpreter, unless the line before the block is `<!-- not run -->`.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from markdown.extensions.toc import slugify

from _paths import ROOT_STR

_DOCS = os.path.join(ROOT_STR, "docs")
_README = os.path.join(ROOT_STR, "README.md")
_NOT_RUN = "<!-- not run -->"
# Fenced blocks: the info string (language) and the body.
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A work-item number ("issue 12", "issues 3 and 4") means nothing to a reader.
_WORK_ITEM = re.compile(r"\bissues? #?\d+", re.I)


def _build(config_file, site_dir):
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", config_file,
         "--site-dir", str(site_dir)],
        capture_output=True, text=True, timeout=120, cwd=os.path.dirname(config_file),
    )


def test_site_builds_strictly(tmp_path):
    result = _build(os.path.join(ROOT_STR, "mkdocs.yml"), tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "fault_tolerance" / "index.html").is_file()


def test_a_broken_link_fails_the_strict_build(tmp_path):
    # Guards mkdocs.yml's validation settings: without them a broken anchor is only INFO.
    copy = tmp_path / "repo"
    shutil.copytree(_DOCS, copy / "docs")
    shutil.copy(os.path.join(ROOT_STR, "mkdocs.yml"), copy / "mkdocs.yml")
    with open(copy / "docs" / "api.md", "a") as f:
        f.write("\nSee [nowhere](fault_tolerance.md#no-such-section).\n")
    result = _build(str(copy / "mkdocs.yml"), tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-section" in result.stdout + result.stderr


def _nav_pages(nav):
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            if isinstance(value, list):
                yield from _nav_pages(value)
            else:
                yield value


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    with open(os.path.join(ROOT_STR, "mkdocs.yml")) as f:
        nav = set(_nav_pages(yaml.safe_load(f)["nav"]))
    pages = {name for name in os.listdir(_DOCS) if name.endswith(".md")}
    assert pages - nav == set(), "pages missing from mkdocs.yml's nav"
    assert nav - pages == set(), "nav entries without a page"


def _headings(path):
    with open(path) as f:
        text = _FENCE.sub("", f.read())
    return {slugify(m.group(1).replace("`", ""), "-") for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_readme_links_point_at_files_and_headings_that_exist():
    with open(_README) as f:
        links = [link for link in _LINK.findall(f.read()) if "://" not in link]
    assert links, "the README links to its docs pages"
    for link in links:
        path, _, anchor = link.partition("#")
        target = os.path.join(ROOT_STR, path)
        assert os.path.exists(target), f"README links to {path}, which does not exist"
        if anchor:
            assert anchor in _headings(target), f"README links to #{anchor}, not a heading of {path}"


def test_no_work_item_numbers_in_the_docs():
    paths = [_README] + [os.path.join(_DOCS, name) for name in os.listdir(_DOCS) if name.endswith(".md")]
    for path in paths:
        with open(path) as f:
            found = _WORK_ITEM.findall(f.read())
        assert not found, f"{os.path.relpath(path, ROOT_STR)} names work items: {found}"


def readme_python_blocks():
    """The README's ```python blocks not marked `<!-- not run -->`, in order."""
    with open(_README) as f:
        text = f.read()
    blocks = []
    for match in _FENCE.finditer(text):
        before = text[:match.start()].rstrip().rsplit("\n", 1)[-1]
        if match.group(1) == "python" and before.strip() != _NOT_RUN:
            blocks.append(match.group(2))
    return blocks


def test_the_readme_marks_blocks_that_are_not_run():
    # The Keras block uses names the reader supplies (train, val, test): it is shown, not run.
    with open(_README) as f:
        python_blocks = sum(1 for m in _FENCE.finditer(f.read()) if m.group(1) == "python")
    runnable = readme_python_blocks()
    assert runnable, "the tour is run"
    assert len(runnable) < python_blocks, "the Keras block is marked not run"


@pytest.mark.cluster
@pytest.mark.parametrize("index", range(len(readme_python_blocks())))
def test_readme_python_block_runs(index, tmp_path):
    code = readme_python_blocks()[index]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT_STR)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=240, cwd=tmp_path, env=env)
    assert result.returncode == 0, f"README python block {index} failed:\n{result.stderr[-4000:]}"
    assert result.stdout.strip(), "the block prints its results"
