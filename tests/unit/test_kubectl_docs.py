"""The how-to's `kubectl get tj` and `kubectl logs` lines match the CRD's columns and the pods."""

from __future__ import annotations

import re
from pathlib import Path

from kiln import api, crd
from kiln.controller import pods

PAGE = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "operator-out-of-cluster.md"


def test_the_wide_output_shown_has_the_crds_printer_columns_in_order() -> None:
    text = PAGE.read_text()
    header = text.split("$ kubectl get tj -o wide\n", 1)[1].splitlines()[0]
    columns = crd.build()["spec"]["versions"][0]["additionalPrinterColumns"]
    assert header.split() == ["NAME", *(c["name"].upper() for c in columns)]


def test_the_log_commands_select_the_labels_and_names_trainer_pods_carry() -> None:
    text = PAGE.read_text()
    selectors = re.findall(r"kubectl logs -l (\S+)", text)
    assert selectors and all(s.startswith(f"{api.JOB_NAME_LABEL}=") for s in selectors)
    assert f"kubectl logs {pods.pod_name('digits-resnet', 1)} " in text
    assert f"`{api.ATTEMPT_LABEL}=<attempt>`" in text
