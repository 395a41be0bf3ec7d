"""The README stays short and the docs site stays whole: links resolve, named paths exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_BYTES = 12_000

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_CODE_PATH = re.compile(r"`((?:operator|trainer_image|helm|crds|examples|bench|docs|tests)/[^`\s]*)`")


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def _table_rows(text: str, heading: str) -> list[str]:
    """The rows of the first table under `heading` (a Markdown heading line)."""
    section = text.split(heading + "\n", 1)[1]
    rows = []
    for line in section.splitlines():
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    return rows[2:]  # without the header and the separator


def test_readme_is_at_most_12_kb() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, (
        f"README.md has {size} bytes (at most {README_MAX_BYTES}): move detail into docs/")


@pytest.mark.parametrize("page", [README, *_pages()], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    missing = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{page.name} links to missing files: {missing}"


@pytest.mark.parametrize(("page", "heading"), [
    pytest.param(README, "## Where each idea lives", id="readme"),
    pytest.param(DOCS / "layout.md", "## Packages", id="docs-layout"),
])
def test_every_path_in_the_layout_tables_exists(page: Path, heading: str) -> None:
    rows = _table_rows(page.read_text(encoding="utf-8"), heading)
    assert rows, f"no table under {heading!r} in {page.name}"
    paths = [path for row in rows for path in _CODE_PATH.findall(row)]
    assert paths
    assert [p for p in paths if not (ROOT / p).exists()] == []


def _modules(package: Path) -> set[str]:
    """The modules of a package folder (not `__init__.py` or `__main__.py`)."""
    return {p.name for p in package.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}


def test_the_docs_module_table_lists_every_module_and_only_those() -> None:
    """docs/layout.md's module table matches the package tree: each package of `kiln` (but
    `kiln` itself, whose modules the Packages table names) and of `kiln_trainer` has a row
    naming all its modules, and nothing else is named."""
    rows = _table_rows((DOCS / "layout.md").read_text(encoding="utf-8"), "## Modules")
    listed = {}
    for row in rows:
        package, modules = re.split(r"(?<!\\)\|", row)[1:3]  # not at an escaped \|
        listed[package.strip().strip("`")] = set(re.findall(r"`(\w+\.py)`", modules))
    folders = [init.parent for init in (ROOT / "operator" / "kiln").rglob("__init__.py")
               if init.parent.name != "kiln"]
    folders += [init.parent for init in (ROOT / "trainer_image").rglob("__init__.py")]
    tree = {f"{folder.relative_to(ROOT)}/": _modules(folder) for folder in folders}
    problems = [f"{package}: no row" for package in sorted(tree.keys() - listed.keys())]
    problems += [f"{package}: no such package" for package in sorted(listed.keys() - tree.keys())]
    for package in sorted(tree.keys() & listed.keys()):
        problems += [f"{package}{m}: not listed" for m in sorted(tree[package] - listed[package])]
        problems += [f"{package}{m}: no such module" for m in sorted(listed[package] - tree[package])]
    assert rows and problems == [], (
        "docs/layout.md's module table and the tree differ (list each module with its "
        "docstring's first line, in a few words): " + "; ".join(problems))


def test_every_top_level_module_is_in_the_docs_packages_table() -> None:
    rows = "\n".join(_table_rows((DOCS / "layout.md").read_text(encoding="utf-8"),
                                 "## Packages"))
    absent = [m for m in sorted(_modules(ROOT / "operator" / "kiln"))
              if f"`operator/kiln/{m}`" not in rows]
    assert absent == [], "name these modules of operator/kiln in docs/layout.md's Packages table"


def test_every_docs_page_is_in_the_site_navigation() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))

    def entries(nav: object) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        if isinstance(nav, list):
            return [e for item in nav for e in entries(item)]
        if isinstance(nav, dict):
            return [e for value in nav.values() for e in entries(value)]
        return []

    listed = set(entries(config["nav"]))
    assert {str(p.relative_to(DOCS)) for p in _pages()} == listed


def test_the_trainer_page_lists_every_flag_and_variable_of_the_contract() -> None:
    from kiln import contract

    page = (DOCS / "concepts" / "trainer.md").read_text()
    missing = [str(name) for name in [*contract.Flag, *contract.Env] if f"`{name}" not in page]
    assert not missing, f"docs/concepts/trainer.md does not mention {missing} (see kiln.contract)"
