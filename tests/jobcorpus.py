"""The job-document corpus under tests/data/jobs/, shared by the API and CRD tests."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

JOBS = Path(__file__).resolve().parent / "data" / "jobs"


def corpus(kind: str) -> list[Any]:
    """Documents of tests/data/jobs/<kind>/ as pytest params (doc, field, message).

    Each file starts with comments ``# field: <path>`` and optionally ``# message: <text>``.
    """
    params = []
    for path in sorted((JOBS / kind).glob("*.yaml")):
        text = path.read_text(encoding="utf-8")
        notes = dict(re.findall(r"^# (field|message): (.*)$", text, flags=re.MULTILINE))
        field, message = notes.get("field", ""), notes.get("message", "")
        params.append(pytest.param(yaml.safe_load(text), field, message, id=path.stem))
    return params
