"""kiln.controller.main: command-line errors come back as exit 2 with the flag named."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.controller import main


@pytest.mark.parametrize(("content", "message"), [
    (None, "cannot read it"),
    ("clusters: [\n", "not valid YAML"),
    ("- just a list\n", "not a kubeconfig"),
])
def test_an_unusable_kubeconfig_is_a_usage_error_naming_the_flag(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None,
        message: str) -> None:
    path = tmp_path / "kubeconfig"
    if content is not None:
        path.write_text(content)
    assert main.main(["--kubeconfig", str(path)]) == 2
    out = capsys.readouterr().out
    assert f"--kubeconfig {path}: {message}" in out
