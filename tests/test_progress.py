"""dgrad.train.progress: a bar on a terminal, lines every few steps elsewhere."""

import io

from dgrad.train.progress import Progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_on_a_terminal_is_tqdm():
    out = Terminal()
    progress = Progress(total=10, start=0, batch_size=8, stream=out, label="fdg_k2 ")
    for step in range(1, 11):
        progress.update(step, loss=0.5)
    progress.close()
    text = out.getvalue()
    assert "\r" in text and text.endswith("\n") and text.count("\n") == 1  # one line, redrawn
    assert "fdg_k2" in text and "100%" in text and "sample/s" in text and "loss=0.5000" in text


def test_progress_lines_elsewhere_come_every_few_steps():
    out = io.StringIO()
    progress = Progress(total=10, start=2, batch_size=8, stream=out, every=4)
    for step in range(3, 11):
        progress.update(step)
    assert [line.split()[1] for line in out.getvalue().splitlines()] == ["4/10", "8/10", "10/10"]
    assert "ETA" in out.getvalue()
