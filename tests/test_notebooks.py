"""Every notebook runs top to bottom (nbclient) at the small size its parameters cell
allows. (The README's snippets run in `test_docs`.)"""

import time

import nbclient
import nbformat
import pytest
from helpers import ROOT

NOTEBOOK_SECONDS = 1200
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SMALL = {  # what the tests set after each notebook's parameters cell
    "quickstart.ipynb": "EPOCHS = 1",
    "optax.ipynb": "EPOCHS = 2",
    "speed.ipynb": "STEPS = 3\nBATCH = 16\nIMAGE = 16",
    "staleness.ipynb": "EPOCHS = 1\nSEEDS = (0,)\nSTAGES = (2,)\nPROBE_STAGES = 2",
    "language_model.ipynb": 'VARIANT = "smoke"\nPROBE_EVERY = 4\nSAMPLE_LENGTH = 40',
}


def test_every_notebook_has_a_small_size():
    assert {path.name for path in NOTEBOOKS} == set(SMALL)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_at_small_size(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)  # cells carry ids, outputs are well formed
    tagged = [i for i, c in enumerate(notebook.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, "a notebook has one cell tagged 'parameters'"
    notebook.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(SMALL[path.name]))
    deadline = time.monotonic() + NOTEBOOK_SECONDS  # for the whole notebook, cell by cell
    client = nbclient.NotebookClient(
        notebook,
        timeout_func=lambda cell: max(1, int(deadline - time.monotonic())),
        kernel_name="python3",
        resources={"metadata": {"path": path.parent}},
    )
    try:
        client.execute()  # shuts its kernel down however it ends
    except nbclient.exceptions.CellTimeoutError:
        printed = "".join(o.get("text", "") for c in notebook.cells for o in c.get("outputs", []))
        raise AssertionError(
            f"{path.name} ran past {NOTEBOOK_SECONDS} s; its kernel was stopped. It printed:\n"
            + printed[-4000:]
        ) from None
    errors = [o for c in notebook.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
