"""The README's TrainingJob reference is generated from the CRD schema and kept current."""

from __future__ import annotations

from pathlib import Path

from kiln import reference

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_reference_matches_the_generated_one() -> None:
    text = README.read_text(encoding="utf-8")
    section = text.split(reference.START, 1)[1].split(reference.END, 1)[0]
    assert section == "\n" + reference.markdown(), "run `kiln crd --readme README.md`"


def test_reference_lists_every_spec_field_with_its_bounds() -> None:
    table = reference.markdown()
    assert "| `spec.training.epochs` | integer | `30` | ≥ 1, ≤ 100000 |" in table
    assert "`spec.runPolicy.cleanPodPolicy`" in table and "`All`, `Running`, `None`" in table
    assert "`spec.model.architecture` | string, **required**" in table
