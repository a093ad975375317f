"""The README's default run and the quickstart notebook work end to end (at small size)."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_default_training_run_learns_digits():
    """Runs in a fresh process: the script sets up its own fake CPU devices."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.train",
            "--methods",
            "bp,ddg,fdg",
            "--epochs",
            "4",
            "--stages",
            "3",
            "--beta",
            "0.7",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = result.stdout.split("Test accuracy:")[1].split("\n")
    accuracies = {
        line.rsplit(maxsplit=1)[0].strip(): float(line.split()[-1])
        for line in summary
        if line.strip()
    }
    assert set(accuracies) == {"BP (fused, 1 device)", "DDG K=3", "FDG K=3"}
    assert all(a > 0.85 for a in accuracies.values()), accuracies  # chance is 0.1


def test_quickstart_notebook_runs():
    notebook = json.loads((ROOT / "notebooks" / "quickstart.ipynb").read_text())
    code = "\n\n".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code")
    code = code.replace("EPOCHS = 5", "EPOCHS = 2")
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "test accuracy" in result.stdout
    difference = float(result.stdout.split("max relative difference:")[1])
    assert difference < 1e-5
