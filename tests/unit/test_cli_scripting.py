"""The `kiln` command in pipes and scripts, driven through the installed entry point: plain
output when piped, `-o json|yaml` that parses back, `--version`, job files from stdin and
folders, shell completion, and the developer commands printing to stdout."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kiln import cli, crd, dashboard
from kiln.controller import metrics, settings

KILN = str(Path(sys.executable).with_name("kiln"))
REPO = Path(__file__).resolve().parents[2]
VERSION = importlib.metadata.version("kiln-operator")

JOB = """\
apiVersion: kiln.dev/v1alpha1
kind: TrainingJob
metadata: {name: NAME}
spec:
  model: {architecture: small_cnn, args: {num_classes: 10}, inputShape: [1, 8, 8]}
  training: {epochs: 1, batchSize: 32}
"""


def kiln(*args: str, stdin: str | None = None, cwd: Path | None = None,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the installed `kiln` with stdout and stderr piped (not a terminal)."""
    return subprocess.run([KILN, *args], input=stdin, capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, **(env or {})}, timeout=300, check=False)


def plain(text: str) -> bool:
    """No box drawing (U+2500-U+257F) and no escape codes (colour, bold)."""
    return "\x1b" not in text and not any("\u2500" <= ch <= "\u257f" for ch in text)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory zoo with two records."""
    import torch

    from kiln.zoo import records, store

    where = tmp_path_factory.mktemp("zoo")
    for number, created in enumerate(("2025-01-01T00:00:00Z", "2025-02-01T00:00:00Z")):
        record = records.ZooRecord(
            id=records.ZooModelId(f"small_cnn-0000000{number}"), architecture="small_cnn",
            args={}, input_shape=(1, 8, 8), modality="image", task="classification",
            dataset="digits", metric_name="validation_accuracy", metric_value=0.5 + number / 4,
            num_params=10, created_time=created, job_name=f"j{number}", job_spec={})
        records.write_record(store.DirStore(where), record, {"w": torch.zeros(2)}, {})
    return where


@pytest.mark.process
def test_version_comes_from_the_package_metadata_everywhere() -> None:
    done = kiln("--version")
    assert (done.returncode, done.stdout) == (0, f"kiln {VERSION}\n")
    assert metrics.VERSION == VERSION
    assert settings.DEFAULT_IMAGE.endswith(f":{VERSION}")
    chart = yaml.safe_load((REPO / "helm/kiln/Chart.yaml").read_text(encoding="utf-8"))
    values = yaml.safe_load((REPO / "helm/kiln/values.yaml").read_text(encoding="utf-8"))
    assert (chart["version"], chart["appVersion"]) == (VERSION, VERSION), (
        "helm/kiln/Chart.yaml: version and appVersion must be pyproject.toml's version")
    assert values["trainer"]["image"] == settings.DEFAULT_IMAGE


@pytest.mark.process
def test_light_commands_start_without_torch(tmp_path: Path) -> None:
    script = ("import sys\nfrom kiln import cli\n"
              "for argv in (['--help'], ['--version'], ['validate', '--help']):\n"
              "    try:\n        cli.main(argv)\n    except SystemExit:\n        pass\n"
              f"assert cli.main(['zoo', 'ls', '--zoo', {str(tmp_path)!r}]) == 0\n"
              "print('loaded:', sorted(m for m in ('torch', 'kopf', 'pyomo', 'networkx')"
              " if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "loaded: []"


@pytest.mark.process
def test_zoo_ls_piped_is_plain_and_json_and_yaml_parse_back(
        zoo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = kiln("zoo", "ls", "--zoo", str(zoo))
    assert table.returncode == 0, table.stderr
    assert plain(table.stdout), table.stdout
    rows = [line.split() for line in table.stdout.splitlines()]
    assert ["small_cnn-00000000", "small_cnn", "digits"] == rows[2][:3]  # title, header, row
    as_json = json.loads(kiln("zoo", "ls", "--zoo", str(zoo), "-o", "json").stdout)
    assert [(r["id"], r["metric_value"]) for r in as_json] == [
        ("small_cnn-00000000", 0.5), ("small_cnn-00000001", 0.75)]
    assert cli.main(["zoo", "ls", "--zoo", str(zoo), "-o", "yaml"]) == cli.EXIT_OK
    assert yaml.safe_load(capsys.readouterr().out) == as_json
    assert cli.main(["zoo", "show", "small_cnn-00000001", "--zoo", str(zoo), "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == as_json[1]


@pytest.mark.process
def test_no_color_on_a_terminal_prints_plain_tables(zoo: Path) -> None:
    def on_a_terminal(env: dict[str, str]) -> str:
        leader, follower = os.openpty()
        subprocess.run([KILN, "zoo", "ls", "--zoo", str(zoo)], stdout=follower,
                       env={**os.environ, "COLUMNS": "200", **env}, timeout=120, check=True)
        os.close(follower)
        shown = b""
        try:
            while chunk := os.read(leader, 65536):
                shown += chunk
        except OSError:  # Linux ends a pty whose other side closed with EIO
            pass
        os.close(leader)
        return shown.decode()

    assert not plain(on_a_terminal({"NO_COLOR": ""}))  # a terminal gets the rich table
    shown = on_a_terminal({"NO_COLOR": "1"})
    assert "small_cnn-00000001" in shown and plain(shown), shown


def test_models_prints_every_architecture_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["models", "-o", "json"]) == cli.EXIT_OK
    names = [row["name"] for row in json.loads(capsys.readouterr().out)]
    assert "small_cnn" in names and names == sorted(names)


@pytest.mark.process
def test_validate_reads_stdin_and_every_job_file_of_a_folder(tmp_path: Path) -> None:
    (tmp_path / "two.yaml").write_text(
        JOB.replace("NAME", "a") + "---\n" + JOB.replace("NAME", "b"), encoding="utf-8")
    (tmp_path / "c.json").write_text(json.dumps(yaml.safe_load(JOB.replace("NAME", "c"))),
                                     encoding="utf-8")
    (tmp_path / "d.yml").write_text(JOB.replace("NAME", "d").replace("epochs", "epoch"),
                                     encoding="utf-8")
    (tmp_path / "e.yaml").write_text(JOB.replace("NAME", "e").replace("epochs: 1", "epochs: 0"),
                                     encoding="utf-8")
    (tmp_path / "notes.txt").write_text("not a job", encoding="utf-8")
    done = kiln("validate", "-", str(tmp_path), "-o", "json",
                stdin=JOB.replace("NAME", "from-stdin"))
    assert done.returncode == 2  # d.yml and e.yaml are invalid: said on stderr, in the verdicts
    assert "d.yml: invalid TrainingJob:\n  spec.training.epoch: unknown field" in done.stderr
    assert "\nerror: " in done.stderr and done.stderr.count("error: ") == 2, done.stderr
    verdicts = json.loads(done.stdout)
    assert [(Path(v["source"]).name, v["name"], v["valid"]) for v in verdicts] == [
        ("<stdin>", "from-stdin", True), ("c.json", "c", True), ("d.yml", "d", False),
        ("e.yaml", "e", False), ("two.yaml", "a", True), ("two.yaml", "b", True)]
    assert any("spec.training.epoch: unknown field" in p for p in verdicts[2]["problems"])


def test_validate_refuses_a_folder_without_job_files(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("not a job", encoding="utf-8")
    assert cli.main(["validate", str(tmp_path)]) == cli.EXIT_USAGE
    assert f"{tmp_path}: the folder holds no job file" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.process
def test_bash_completion_completes_commands_and_zoo_actions(tmp_path: Path) -> None:
    script = tmp_path / "kiln.bash"
    script.write_text(kiln("completion", "bash").stdout, encoding="utf-8")
    probe = (f"source {script}\n"
             "COMP_WORDS=(kiln zoo ''); COMP_CWORD=2; COMP_LINE='kiln zoo '; COMP_POINT=9\n"
             "_shtab_kiln; printf '%s\\n' \"${COMPREPLY[@]}\"\n")
    done = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert {"ls", "show", "rm", "query"} <= set(done.stdout.split())
    zsh = kiln("completion", "zsh")
    assert zsh.returncode == 0 and zsh.stdout.startswith("#compdef kiln")


@pytest.mark.process
def test_crd_and_dashboard_print_to_stdout_and_stay_out_of_the_help(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    printed = kiln("crd")
    assert printed.returncode == 0 and printed.stdout.startswith(crd.HEADER)
    # Every CRD, one YAML stream: `kiln crd | kubectl apply -f -` installs them.
    docs = list(yaml.safe_load_all(printed.stdout))
    assert [d["kind"] for d in docs] == ["CustomResourceDefinition"] * 4
    assert {d["spec"]["names"]["kind"] for d in docs} == {
        "TrainingJob", "TrainingSweep", "TrainingRuntime", "ClusterTrainingRuntime"}
    written = kiln("crd", "--out", str(tmp_path / "crd.yaml"), "--out", "-", cwd=tmp_path)
    assert written.stdout == printed.stdout and not (tmp_path / "-").exists()
    assert (tmp_path / "crd.yaml").read_text(encoding="utf-8") == printed.stdout
    assert f"wrote {tmp_path / 'crd.yaml'}" in written.stderr
    assert cli.main(["dashboard"]) == cli.EXIT_OK
    assert capsys.readouterr().out == dashboard.render()
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    usage = capsys.readouterr().out
    assert "crd" not in usage and "dashboard" not in usage and "completion" in usage
