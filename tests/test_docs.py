"""The code in the README and in the documentation pages (`docs/`) runs as written.

The convention, for README.md and every page under docs/:

- A ```` ```python ```` block is a whole script. It runs on its own, as `python snippet.py`
  from the repository root, in a process of its own, so it sets up what it needs (fake
  devices, data) itself, and it asserts what a reader should see rather than showing
  printed output that could drift. An exception fails the test.
- A ```` ```bash ```` block is a command and a ```` ```text ```` block printed output or a
  file listing: neither is run. The README keeps its commands as indented blocks, which are
  not run either.
- Every fenced block names one of these three languages, so that no Python escapes the tests
  under another name.

The README's two `Use` examples train for minutes and are slow tests; the pages' snippets
take seconds each and are in the fast subset. Building the site itself (`mkdocs build
--strict`, which also checks the pages' links) is the CI's job (`.ci/run`); here the README's
links into docs/ are checked, since the site does not build the README.
"""

import re
import sys

import pytest
from helpers import ROOT
from processes import run_command

LANGUAGES = ("python", "bash", "text")
PAGES = sorted((ROOT / "docs").rglob("*.md"))
SNIPPET_SECONDS = 600


def python_blocks(path):
    """The ```python blocks of a Markdown file, in order."""
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def readme_snippets():
    return python_blocks(ROOT / "README.md")


def page_snippets():
    return [(path, i) for path in PAGES for i in range(len(python_blocks(path)))]


def run_snippet(code, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(code)
    run_command([sys.executable, str(script)], timeout=SNIPPET_SECONDS, cwd=ROOT)


def test_the_readme_has_snippets():
    assert len(readme_snippets()) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(readme_snippets())))
def test_readme_snippet_runs_as_written(index, tmp_path):
    run_snippet(readme_snippets()[index], tmp_path)


@pytest.mark.parametrize(
    "path,index", page_snippets(), ids=[f"{p.relative_to(ROOT)}-{i}" for p, i in page_snippets()]
)
def test_page_snippet_runs_as_written(path, index, tmp_path):
    run_snippet(python_blocks(path)[index], tmp_path)


@pytest.mark.parametrize(
    "path", [ROOT / "README.md", *PAGES], ids=lambda p: str(p.relative_to(ROOT))
)
def test_every_fenced_block_names_its_language(path):
    opening = re.findall(r"^```(.*)\n(?:.*\n)*?^```\s*$", path.read_text(), flags=re.M)
    assert set(opening) <= set(LANGUAGES), f"{path.name}: fences {sorted(set(opening))}"


def test_every_page_is_in_the_site():
    nav = set(re.findall(r"^\s*-\s.*?:\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    assert nav == {str(p.relative_to(ROOT / "docs")) for p in PAGES}


def anchor(heading):
    """The id Python-Markdown's table of contents gives a heading."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_the_readme_links_to_pages_that_exist():
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", (ROOT / "README.md").read_text())
    assert links
    for target, fragment in links:
        path = ROOT / target
        assert path.is_file(), f"README links to {target}, which does not exist"
        if fragment:
            headings = re.findall(r"^#+ (.*)$", path.read_text(), flags=re.M)
            assert fragment in {anchor(h) for h in headings}, f"no #{fragment} in {target}"


def test_doctests_of_the_api_pages_become_code_blocks():
    """The site's griffe extension (docs/doctest_fences.py) fences `>>>` examples; it needs
    the `docs` extra, and the test is skipped without it."""
    pytest.importorskip("griffe")
    import doctest
    import importlib.util

    spec = importlib.util.spec_from_file_location("doctest_fences", ROOT / "docs/doctest_fences.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert doctest.testmod(module).failed == 0
    fenced = module.fence_doctests("Args:\n  x: a value.\n\n  >>> [1, 2][0]\n  1\nAfter.")
    assert fenced.splitlines()[3:] == ["  ```pycon", "  >>> [1, 2][0]", "  1", "After.", "  ```"]
