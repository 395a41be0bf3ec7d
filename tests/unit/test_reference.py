"""The docs' TrainingJob reference is generated from the CRD schema and kept current."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln import cli, reference

ROOT = Path(__file__).resolve().parents[2]


def test_docs_reference_matches_the_generated_one() -> None:
    text = (ROOT / reference.PAGE).read_text(encoding="utf-8")
    section = text.split(reference.START, 1)[1].split(reference.END, 1)[0]
    assert section == "\n" + reference.markdown(), "run `kiln crd --write` in the repository root"


def test_reference_lists_every_spec_field_with_its_bounds() -> None:
    table = reference.markdown()
    assert "| `spec.training.epochs` | integer | `30` | ≥ 1, ≤ 100000 |" in table
    assert "`spec.runPolicy.cleanPodPolicy`" in table and "`All`, `Running`, `None`" in table
    assert "`spec.model.inputShape` | list of integer, **required**" in table
    assert "| `spec.model.architecture` | string |" in table  # or spec.model.entrypoint
    assert "| `spec.model.task` | string |  | `classification`, `language_model` |" in table


def test_update_rewrites_only_the_text_between_the_markers(tmp_path: Path) -> None:
    page = tmp_path / "trainingjob.md"
    page.write_text(f"# Intro\n\n{reference.START}\nstale\n{reference.END}\n\nRules.\n",
                    encoding="utf-8")
    assert reference.update(page) is True
    assert page.read_text(encoding="utf-8") == (
        f"# Intro\n\n{reference.START}\n{reference.markdown()}{reference.END}\n\nRules.\n")
    assert reference.update(page) is False


def test_update_names_the_missing_markers(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# No markers\n", encoding="utf-8")
    with pytest.raises(ValueError, match="reference:start"):
        reference.update(page)


def test_kiln_crd_regenerates_the_reference_page_it_is_given(tmp_path: Path) -> None:
    page = tmp_path / "trainingjob.md"
    page.write_text(f"{reference.START}\n{reference.END}\n", encoding="utf-8")
    out = tmp_path / "crd.yaml"
    assert cli.main(["crd", f"--out={out}", f"--reference={page}"]) == cli.EXIT_OK
    expected = f"{reference.START}\n{reference.markdown()}{reference.END}\n"
    assert page.read_text(encoding="utf-8") == expected


def test_kiln_crd_refuses_a_reference_page_without_markers(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# No markers\n", encoding="utf-8")
    out = tmp_path / "crd.yaml"
    assert cli.main(["crd", f"--out={out}", f"--reference={page}"]) == cli.EXIT_USAGE
