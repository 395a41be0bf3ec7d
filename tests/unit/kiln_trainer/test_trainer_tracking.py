"""How the trainer's console lines state a share (kiln_trainer.tracking)."""

from __future__ import annotations

import pytest

from kiln_trainer import tracking


@pytest.mark.parametrize(("fraction", "shown"), [
    (0.0, "0%"), (0.004, "0.4%"), (0.31, "31%"), (0.996, "99.6%"), (0.9999, "99.9%"),
    (1.0, "100%"),
], ids=["none", "sliver", "middle", "almost-all", "never-rounds-up", "all"])
def test_a_share_never_rounds_to_all_or_nothing(fraction: float, shown: str) -> None:
    assert tracking._share(fraction) == shown
