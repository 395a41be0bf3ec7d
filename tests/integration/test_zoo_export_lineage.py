"""`kiln zoo export`/`import` round trips, `kiln zoo lineage` and `kiln zoo ls` filters, all
through the real CLI (`kiln.cli.main`) on directory zoos."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from zoofactory import add

from kiln import cli
from kiln.zoo import records, store


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    assert code == cli.EXIT_OK, captured.err
    return captured.out


def _real(zoo: store.ObjectStore, record_id: str) -> records.ZooRecord:
    """A record holding the weights of the small_cnn its meta.json describes."""
    import torch

    from kiln import api, models

    spec = api.ModelSpec.model_validate({"architecture": "small_cnn", "args": {"width": 8},
                                         "inputShape": [1, 8, 8]})
    torch.manual_seed(3)
    rec = add(zoo, record_id, floats=1, args={"width": 8})
    records.delete_record(zoo, rec.id)
    return records.write_record(zoo, dataclasses.replace(rec, weights_sha256=""),
                                models.build(spec).state_dict(), {"nodes": []})


def test_export_then_import_round_trips_weights_bit_exact(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, target = store.DirStore(tmp_path / "a"), store.DirStore(tmp_path / "b")
    rec = _real(source, "small_cnn-0a0b0c0d")
    out = tmp_path / "export"
    _run(capsys, "zoo", "export", rec.id, "--out", str(out), "--zoo", str(source.root))
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "graph.json", "meta.json", "weights.safetensors"]
    assert "load_state_dict(load_file('weights.safetensors'))" in (out / "README.md").read_text()
    _run(capsys, "zoo", "import", str(out), "--zoo", str(target.root))
    prefix = records.record_prefix(rec.id) + records.WEIGHTS_NAME
    assert target.get_bytes(prefix) == source.get_bytes(prefix)
    assert records.verify_record(target, rec.id).weights_sha256 == rec.weights_sha256
    # Importing it again succeeds and changes nothing (a rerun script), saying so.
    said = _run(capsys, "zoo", "import", str(out), "--zoo", str(target.root))
    assert f"{rec.id} is already in the zoo with the same weights" in " ".join(said.split())
    assert records.verify_record(target, rec.id).weights_sha256 == rec.weights_sha256


def test_a_language_model_round_trips_through_export_and_import(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import safetensors.torch

    from kiln import api, models

    model = {"architecture": "char_transformer", "args": {"depth": 1, "width": 16, "heads": 2},
             "inputShape": [8]}
    weights = tmp_path / "lm.safetensors"
    safetensors.torch.save_model(models.build(api.ModelSpec.model_validate(model)),
                                 str(weights))
    _run(capsys, "zoo", "import", str(weights), "--architecture", "char_transformer", "--args",
         json.dumps(model["args"]), "--input-shape", "8", "--metric", "validation_loss=2.5",
         "--zoo", str(tmp_path / "a"))
    (rec,) = records.list_records(store.DirStore(tmp_path / "a"))
    out = tmp_path / "export"
    _run(capsys, "zoo", "export", rec.id, "--out", str(out), "--zoo", str(tmp_path / "a"))
    said = _run(capsys, "zoo", "import", str(out), "--zoo", str(tmp_path / "b"))
    assert said.startswith(f"imported {rec.id}: char_transformer"), said
    assert records.verify_record(store.DirStore(tmp_path / "b"), rec.id).task == rec.task


def test_import_refuses_an_export_whose_weights_changed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = store.DirStore(tmp_path / "a")
    rec = add(source, "small_cnn-0a0b0c0e", floats=50, seed=1)
    out = tmp_path / "export"
    _run(capsys, "zoo", "export", rec.id, "--out", str(out), "--zoo", str(source.root))
    data = bytearray((out / "weights.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (out / "weights.safetensors").write_bytes(bytes(data))
    assert cli.main(["zoo", "import", str(out), "--zoo", str(tmp_path / "b")]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert hashlib.sha256(bytes(data)).hexdigest() in err and "export it again" in err
    assert not store.DirStore(tmp_path / "b").list_keys("models/")


def test_lineage_shows_parents_children_similarity_and_inherited_epochs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    zoo = store.DirStore(tmp_path / "zoo")
    spec = {"training": {"epochs": 10}}
    add(zoo, "root-00000001", floats=10, days_old=3, job_spec=spec)
    add(zoo, "mid-00000002", floats=10, days_old=2, job_spec=spec,
        parent=records.ZooModelId("root-00000001"), similarity=0.5)
    add(zoo, "leaf-00000003", floats=10, days_old=1, job_spec=spec,
        parent=records.ZooModelId("mid-00000002"), similarity=1.0)
    add(zoo, "cold-00000004", floats=10, days_old=1, job_spec=spec)
    found = json.loads(_run(capsys, "zoo", "lineage", "mid-00000002", "--zoo", str(zoo.root),
                            "-o", "json"))
    assert [a["id"] for a in found["ancestors"]] == ["root-00000001"]
    tree = found["tree"]
    assert (tree["id"], tree["similarity"], tree["inherited_epochs"]) == (
        "mid-00000002", 0.5, 5.0)
    leaf = tree["children"][0]
    assert (leaf["id"], leaf["inherited_epochs"]) == ("leaf-00000003", 15.0)  # 1.0 x (10 + 5)
    text = _run(capsys, "zoo", "lineage", "leaf-00000003", "--zoo", str(zoo.root))
    assert "root-00000001" in text and "saved ~15.0 epochs" in text
    assert "cold-00000004" not in text


def test_lineage_counts_what_a_pruned_trials_provisional_record_trained_not_its_plan(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A trial pruned after 2 of its 10 epochs keeps its provisional record; a later trial
    # warm-started from it (similarity 1) saved those 2 epochs, not 10.
    zoo = store.DirStore(tmp_path / "zoo")
    spec = {"training": {"epochs": 10}}
    add(zoo, "pruned-00000001", floats=10, days_old=2, job_spec=spec, provisional=True,
        history=[{"step": 10, "epoch": 1}, {"step": 20, "epoch": 2}])
    add(zoo, "child-00000002", floats=10, days_old=1, job_spec=spec,
        parent=records.ZooModelId("pruned-00000001"), similarity=1.0)
    found = json.loads(_run(capsys, "zoo", "lineage", "child-00000002", "--zoo",
                            str(zoo.root), "-o", "json"))
    assert (found["ancestors"][0]["own_epochs"], found["tree"]["inherited_epochs"]) == (2, 2.0)
    text = _run(capsys, "zoo", "lineage", "pruned-00000001", "--zoo", str(zoo.root))
    assert "saved ~2.0 epochs" in text and "pruned-00000001  small_cnn" in text
    root = next(line for line in text.splitlines() if "pruned-00000001  " in line)
    assert "cold" in root and "similarity" not in root  # its own start was cold


def test_ls_filters_sorts_and_prints_json(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    zoo = store.DirStore(tmp_path / "zoo")
    add(zoo, "cnn-00000001", floats=10, metric_value=0.5)
    add(zoo, "cnn-00000002", floats=10, metric_value=0.9)
    add(zoo, "mlp-00000003", floats=10, architecture="mlp")
    add(zoo, "text-00000004", floats=10, dataset="wikitext")
    rows = json.loads(_run(capsys, "zoo", "ls", "--zoo", str(zoo.root), "--architecture",
                           "small_cnn", "--dataset", "digits", "--sort", "metric", "-o", "json"))
    assert [r["id"] for r in rows] == ["cnn-00000002", "cnn-00000001"]
    table = _run(capsys, "zoo", "ls", "--zoo", str(zoo.root), "--architecture", "small_cnn",
                 "--sort", "metric")
    assert table.index("cnn-00000002") < table.index("cnn-00000001")  # the table keeps --sort
    table = _run(capsys, "zoo", "ls", "--zoo", str(zoo.root), "--architecture", "mlp")
    assert "mlp-00000003" in table and "cnn-00000001" not in table


def test_the_exports_readme_snippet_loads_the_model(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from kiln import api, models

    spec = api.ModelSpec.model_validate({"architecture": "small_cnn", "args": {"width": 8},
                                         "inputShape": [1, 8, 8]})
    trained = models.build(spec)
    zoo = store.DirStore(tmp_path / "zoo")
    rec = add(zoo, "small_cnn-00c0ffee", floats=1, args={"width": 8})
    records.delete_record(zoo, rec.id)  # the same record, with the model's real weights
    records.write_record(zoo, dataclasses.replace(rec, weights_sha256=""),
                         trained.state_dict(), {"nodes": []})
    out = tmp_path / "export"
    _run(capsys, "zoo", "export", rec.id, "--out", str(out), "--zoo", str(zoo.root))
    snippet = (out / "README.md").read_text().split("```python\n")[1].split("```")[0]
    monkeypatch.chdir(out)
    scope: dict[str, Any] = {}
    exec(snippet, scope)  # noqa: S102 - the README we wrote, run as a user would paste it
    for name, tensor in trained.state_dict().items():
        assert torch.equal(scope["model"].state_dict()[name], tensor), name


def test_lineage_names_a_parent_cycle_and_shows_each_record_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    zoo = store.DirStore(tmp_path / "zoo")  # a -> b -> c -> a, as hand-edited meta.json give
    for child, parent in (("a-00000001", "b-00000002"), ("b-00000002", "c-00000003"),
                          ("c-00000003", "a-00000001"), ("self-00000004", "self-00000004")):
        add(zoo, child, floats=10, parent=records.ZooModelId(parent), similarity=0.5)
    found = json.loads(_run(capsys, "zoo", "lineage", "a-00000001", "--zoo", str(zoo.root),
                            "-o", "json"))
    assert found["cycles"] == [["a-00000001", "b-00000002", "c-00000003"]]
    assert found["ancestors"] == []  # its parents are all its descendants too
    tree, ids = found["tree"], []
    while tree:
        ids.append(tree["id"])
        tree = tree["children"][0] if tree["children"] else None
    assert ids == ["a-00000001", "c-00000003", "b-00000002"]
    text = _run(capsys, "zoo", "lineage", "b-00000002", "--zoo", str(zoo.root))
    assert all(text.count(f"{n}-0000000{i}  ") == 1 for i, n in enumerate("abc", 1)), text
    assert "parent cycle a-00000001 -> b-00000002 -> c-00000003 -> a-00000001" in text
    alone = json.loads(_run(capsys, "zoo", "lineage", "self-00000004", "--zoo", str(zoo.root),
                            "-o", "json"))
    assert alone["cycles"] == [["self-00000004"]] and alone["tree"]["children"] == []
    assert "parent cycle self-00000004 -> self-00000004" in _run(
        capsys, "zoo", "lineage", "self-00000004", "--zoo", str(zoo.root))


def test_export_refuses_a_folder_with_other_files_but_rewrites_its_own_export(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    zoo = store.DirStore(tmp_path / "zoo")
    rec = add(zoo, "small_cnn-0a0b0c1f", floats=20)
    other = add(zoo, "small_cnn-0a0b0c2f", floats=20)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "README.md").write_text("my notes")
    argv = ["zoo", "export", rec.id, "--zoo", str(zoo.root), "--out"]
    assert cli.main([*argv, str(mine)]) == cli.EXIT_USAGE
    assert "is not empty (it holds README.md)" in " ".join(capsys.readouterr().err.split())
    assert (mine / "README.md").read_text() == "my notes"
    out = tmp_path / "out"
    _run(capsys, *argv, str(out))
    _run(capsys, *argv, str(out))  # the same export again: a rerun script succeeds
    assert cli.main(["zoo", "export", other.id, "--zoo", str(zoo.root), "--out", str(out)]
                    ) == cli.EXIT_USAGE
    assert f"no earlier export of {other.id}" in " ".join(capsys.readouterr().err.split())
    assert json.loads((out / "meta.json").read_text())["id"] == rec.id


def _tamper_meta(out: Path, **changes: Any) -> None:
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, **changes}))


@pytest.mark.parametrize(("change", "message"), [
    pytest.param({"architecture": "nope_net"}, "no model can be built (unknown architecture "
                 "'nope_net'", id="architecture"),
    pytest.param({"args": {"width": 16}}, "tensors have other shapes than the model's",
                 id="args"),
    pytest.param({"input_shape": [3, 8, 8]}, "stem.0.weight: file [8, 1, 3, 3], model [8, 3, "
                 "3, 3]", id="input-shape"),
    pytest.param({"task": "regression"}, "meta.json: task: Input should be", id="task"),
    pytest.param({"metric_name": "validation_loss", "metric_value": -1.0},
                 "meta.json: validation_loss: a loss is a cross-entropy, at least 0",
                 id="negative-loss"),
    pytest.param({}, "num_batches_tracked: file [7, 7], model []", id="tensor-shape"),
])
def test_import_refuses_an_export_whose_weights_do_not_fit_its_model(
        change: dict[str, Any], message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    import safetensors.torch
    import torch

    source = store.DirStore(tmp_path / "a")
    rec = _real(source, "small_cnn-0a0b0c1e")
    out = tmp_path / "export"
    _run(capsys, "zoo", "export", rec.id, "--out", str(out), "--zoo", str(source.root))
    if not change:  # a tensor of another shape, with meta.json's checksum made to match
        state = safetensors.torch.load_file(out / "weights.safetensors")
        name = next(k for k in state if k.endswith("num_batches_tracked"))
        state[name] = torch.zeros(7, 7, dtype=torch.long)
        safetensors.torch.save_file(state, out / "weights.safetensors")
        change = {"weights_sha256": hashlib.sha256(
            (out / "weights.safetensors").read_bytes()).hexdigest()}
    _tamper_meta(out, **change)
    assert cli.main(["zoo", "import", str(out), "--zoo", str(tmp_path / "b")]) == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert message in err and "export it again" in err, err
    assert str(out) in err
    assert not store.DirStore(tmp_path / "b").list_keys("models/")


def test_export_to_a_folder_it_cannot_write_is_a_usage_error_not_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    zoo = store.DirStore(tmp_path / "zoo")
    rec = add(zoo, "small_cnn-0a0b0c3f", floats=20)
    (tmp_path / "afile").write_text("mine")
    out = tmp_path / "afile" / "sub"  # below a file: the folder cannot be made
    argv = ["zoo", "export", rec.id, "--zoo", str(zoo.root), "--out", str(out)]
    assert cli.main(argv) == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert f"--out {out}: cannot write the export (Not a directory" in err
    assert (tmp_path / "afile").read_text() == "mine"


@pytest.mark.parametrize("damage", ["weights", "meta"])
def test_lineage_of_an_unusable_record_says_why_not_that_there_is_none(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str) -> None:
    zoo = store.DirStore(tmp_path / "zoo")
    rec = add(zoo, "small_cnn-0a0b0c4f", floats=20)
    prefix = records.record_prefix(rec.id)
    if damage == "weights":
        zoo.delete(prefix + records.WEIGHTS_NAME)
    else:
        zoo.put_bytes(prefix + records.META_NAME, b'{"id": ')
    assert cli.main(["zoo", "lineage", rec.id, "--zoo", str(zoo.root)]) == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert f"zoo record {rec.id} in directory {zoo.root} is unusable" in err
    assert f"kiln zoo rm {rec.id}" in err and "no zoo model" not in err
    assert ("weights.safetensors missing" if damage == "weights" else "not valid JSON") in err
