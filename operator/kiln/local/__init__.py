"""Local mode: `kiln run` on one machine — the runner, the run plan, device discovery, tables."""
