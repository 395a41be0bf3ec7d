"""`kiln` start-up cost: wall seconds of light commands, and what `kiln --help` imports.

Writes bench/results/cli_startup.json and .png (method in the comment below the imports).

    python bench/cli_startup.py [--quick] [--repeats 10]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

# Each command runs `repeats` times as a fresh process of the installed `kiln` script (stdout
# to a pipe, as in a script), after one untimed warm-up run that fills the OS file cache; the
# median wall time is reported. `python -X importtime -m kiln.cli --help` gives, per top-level
# module, the cumulative import microseconds; the largest are listed, and whether torch, kopf
# or pyomo were imported at all. Light commands (help, version, the zoo on an empty folder)
# must not import torch; `validate` and `models` read the model registry, which does.
# Summary keys: `<command>_seconds` (median), `help_imports_torch`, `help_top_imports`.

NAME = "cli_startup"
KILN = str(Path(sys.executable).with_name("kiln"))
HEAVY = ("torch", "kopf", "pyomo", "networkx", "minio", "pydantic")


def commands(scratch: Path) -> dict[str, list[str]]:
    """The timed commands by name (an empty zoo and a job file in `scratch`)."""
    job = Path(__file__).resolve().parents[1] / "examples" / "digits-resnet.yaml"
    return {"help": ["--help"], "version": ["--version"],
            "zoo_ls": ["zoo", "ls", "--zoo", str(scratch / "zoo")],
            "completion": ["completion", "bash"],
            "validate": ["validate", str(job)], "models": ["models"]}


def median_seconds(argv: list[str], *, repeats: int) -> float:
    """Median wall seconds of `kiln argv` over `repeats` runs, after one warm-up run."""
    seconds = []
    for attempt in range(repeats + 1):
        start = time.perf_counter()
        subprocess.run([KILN, *argv], capture_output=True, check=True)
        if attempt:
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def import_times(argv: list[str]) -> dict[str, int]:
    """Cumulative import microseconds per module while `kiln argv` runs (`-X importtime`)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "kiln.cli", *argv],
                          capture_output=True, text=True, check=True)
    cumulative = {}
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and "|" in line and "cumulative" not in line:
            _, total, name = line.split("|")
            cumulative[name.strip()] = int(total)
    return cumulative


def plot(seconds: dict[str, float]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    fig, ax = pyplot.subplots(figsize=(6, 3))
    ax.barh(list(seconds), list(seconds.values()), color="tab:blue")
    ax.set_xlabel("median wall seconds (fresh process)")
    ax.invert_yaxis()
    path: Path = common.save_figure(fig, common.plot_path(NAME), title="kiln start-up by command")
    return path


def main() -> None:
    parser = common.arguments(__doc__ or "", "3 runs per command instead of --repeats")
    parser.add_argument("--repeats", type=int, default=10, help="runs per command (default 10)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    repeats = 3 if args.quick else args.repeats
    with tempfile.TemporaryDirectory() as scratch:
        seconds = {name: median_seconds(argv, repeats=repeats)
                   for name, argv in commands(Path(scratch)).items()}
    imports = import_times(["--help"])
    top_level = {name: us for name, us in imports.items() if "." not in name}
    top = dict(sorted(top_level.items(), key=lambda item: -item[1])[:10])
    summary: dict[str, Any] = {f"{name}_seconds": round(s, 3) for name, s in seconds.items()}
    summary["help_imports_torch"] = "torch" in imports
    summary["help_top_imports"] = {name: round(us / 1e6, 3) for name, us in top.items()}
    details = {"repeats": repeats, "help_heavy_imports": [m for m in HEAVY if m in imports],
               "load_average_1min": os.getloadavg()[0]}  # a busy machine slows every start
    print(f"{'command':<12} median s")
    for name, s in seconds.items():
        print(f"{name:<12} {s:8.3f}")
    print("kiln --help imports:", ", ".join(f"{n} {us / 1e6:.2f}s" for n, us in top.items()))
    path = common.write_results(NAME, summary, details)
    print(f"wrote {path} and {plot(seconds)}")


if __name__ == "__main__":
    main()
