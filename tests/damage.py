"""What a full disk, a bad copy or a hand edit can leave of a checkpoint, for the tests
that check a resume gets past it."""

import json
import os

DAMAGES = {  # how -> what the line that names the checkpoint says failed
    "truncated data": "OUT_OF_RANGE",
    "deleted data": "NOT_FOUND",
    "corrupt meta": "its meta: JSONDecodeError",
    "corrupt array metadata": "JSONDecodeError",
    "other structure": "parameters in the checkpoint",
}


def damage(checkpoint, how: str) -> None:
    """Damages the checkpoint directory `checkpoint` (`<checkpoints>/<step>`) as `how` says."""
    state = checkpoint / "state"
    data = sorted(path for path in state.rglob("*") if path.parent.name == "d")
    assert data, f"no data files under {state}"
    if how == "truncated data":
        for path in data:
            os.truncate(path, path.stat().st_size // 2)
    elif how == "deleted data":
        for path in data:
            path.unlink()
    elif how == "corrupt meta":
        (checkpoint / "meta" / "metadata").write_text('{"step": 1')
    elif how == "corrupt array metadata":
        (state / "_METADATA").write_text('{"tree_metadata": ')
    elif how == "other structure":  # a state without one of the run's arrays
        metadata = json.loads((state / "_METADATA").read_text())
        weights = [key for key in metadata["tree_metadata"] if "'params'" in key]
        del metadata["tree_metadata"][weights[-1]]
        (state / "_METADATA").write_text(json.dumps(metadata))
    else:
        raise ValueError(f"unknown damage {how!r}; choose one of {sorted(DAMAGES)}")


def snapshot(directory) -> dict[str, tuple[int, int]]:
    """Every file under `directory` with its size and modification time."""
    return {
        str(path.relative_to(directory)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def unfinish(workdir) -> None:
    """The workdir's state as a command killed before the end of its experiment leaves it."""
    path = workdir / "workdir.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "finished_epochs": None}))
