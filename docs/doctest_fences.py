"""A griffe extension for the API pages: each doctest in a docstring becomes a `pycon` block.

dgrad's docstrings carry runnable examples as bare `>>>` lines (the doctest suite runs them).
Markdown would read `>>>` as nested quotes and `[1, 2][0]` as a link, so before mkdocstrings
renders a docstring, every run of lines from a `>>>` prompt to the next blank line is fenced
as a `pycon` code block, at the prompt's indentation. Nothing else in the docstring changes.
"""

from __future__ import annotations

import griffe


def fence_doctests(text: str) -> str:
    r"""Fences every doctest example (a `>>>` line up to the next blank line) as `pycon`.

    >>> fence_doctests("Text.\n\n>>> 1 + 1\n2\n\nMore.").splitlines()
    ['Text.', '', '```pycon', '>>> 1 + 1', '2', '```', '', 'More.']
    """
    out, indent, fenced = [], "", False
    for line in text.splitlines():
        stripped = line.lstrip()
        if fenced and not stripped:
            out.append(indent + "```")
            fenced = False
        elif not fenced and stripped.startswith(">>>"):
            indent = line[: len(line) - len(stripped)]
            out.append(indent + "```pycon")
            fenced = True
        elif fenced and stripped.startswith("```"):
            out.append(indent + "```")  # a fence of the docstring's own ends the example
            fenced = False
        out.append(line)
    if fenced:
        out.append(indent + "```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    """Fences the doctests of every docstring griffe loads (see `fence_doctests`)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
