"""The quickstart notebook runs end to end (at small size); the CLI is tested in test_experiment."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_quickstart_notebook_runs():
    notebook = json.loads((ROOT / "notebooks" / "quickstart.ipynb").read_text())
    code = "\n\n".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code")
    code = code.replace("EPOCHS = 5", "EPOCHS = 2")
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "test accuracy" in result.stdout
    difference = float(result.stdout.split("max relative difference:")[1].split()[0])
    assert difference < 1e-5
    assert "'FDG K=2'" in result.stdout and "'BP (fused, 1 device)'" in result.stdout
