"""The docs' TrainingJob and TrainingSweep references are generated from the CRD schemas and
kept current."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln import cli, crd, reference

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("resource", [pytest.param(r, id=r.kind) for r in crd.RESOURCES])
def test_docs_reference_matches_the_generated_one(resource: crd.Resource) -> None:
    text = (ROOT / reference.PAGES[resource]).read_text(encoding="utf-8")
    section = text.split(reference.START, 1)[1].split(reference.END, 1)[0]
    assert section == "\n" + reference.markdown(resource), (
        "run `kiln crd --write` in the repository root")


def test_sweep_reference_lists_the_search_and_leaves_the_template_to_the_jobs_page() -> None:
    table = reference.markdown(crd.SWEEP)
    assert "| `spec.template` | object, **required** |" in table
    assert "`spec.template." not in table  # its fields are the TrainingJob page's
    assert "| `spec.parameters[].int.step` | integer | `1` | ≥ 1 |" in table
    assert "| `spec.algorithm.seed` | integer | `0` | ≥ 0, ≤ 2147483647 |" in table
    assert "`spec.warmStart` | string | `\"chain\"` | `chain`, `independent` |" in table
    page = (ROOT / reference.PAGES[crd.SWEEP]).read_text(encoding="utf-8")
    assert "](trainingjob.md" in page


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


@pytest.mark.parametrize("kind", [[], ["--kind", "TrainingSweep"]], ids=["default", "sweep"])
def test_kiln_crd_regenerates_the_reference_page_it_is_given(tmp_path: Path,
                                                            kind: list[str]) -> None:
    page = tmp_path / "trainingjob.md"
    page.write_text(f"{reference.START}\n{reference.END}\n", encoding="utf-8")
    out = tmp_path / "crd.yaml"
    assert cli.main(["crd", *kind, f"--out={out}", f"--reference={page}"]) == cli.EXIT_OK
    table = reference.markdown(crd.SWEEP if kind else crd.JOB)
    assert page.read_text(encoding="utf-8") == f"{reference.START}\n{table}{reference.END}\n"


def test_kiln_crd_refuses_a_reference_page_without_markers(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# No markers\n", encoding="utf-8")
    out = tmp_path / "crd.yaml"
    assert cli.main(["crd", f"--out={out}", f"--reference={page}"]) == cli.EXIT_USAGE
