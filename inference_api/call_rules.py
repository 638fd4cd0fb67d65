"""Lark rules shared by the grammars of calls written as a function's name and its parameters (Gemma 4's
notation, LFM2's Python calls): which parameters are written, in what order, with what between two."""

from __future__ import annotations


def listed_parameters(i: int, optional: list[bool], separator: str, j: int = 0) -> str:
    """The parameters of function i from the j-th on (rules `parameter_{i}_{j}`), as a Lark expression: in
    their schema's order, `separator` (a Lark literal) between two, the optional ones left out or not; the
    first one written has no separator before it."""
    if j == len(optional):
        return ""
    here = " ".join(filter(None, [f"parameter_{i}_{j}", _after_separator(i, optional, separator, j + 1)]))
    if not optional[j]:
        return here
    later = listed_parameters(i, optional, separator, j + 1)  # this one left out: a later one opens the list
    return f"({here} | {later})" if later else f"({here})?"


def _after_separator(i: int, optional: list[bool], separator: str, j: int) -> str:
    """The parameters from the j-th on, after one already written: each after the separator."""
    parts = [f"{separator} parameter_{i}_{k}" for k in range(j, len(optional))]
    return " ".join(f"({part})?" if optional[k] else part for k, part in enumerate(parts, start=j))
