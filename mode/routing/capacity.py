"""Capacity arithmetic, exact for decimal inputs.

Users write capacities as decimals (``0.29``, ``1.1``), which binary floats cannot hold: ``0.29 * 100`` is
``28.999999999999996`` and ``1.1 * 100 / 11`` is ``10.000000000000002``. Taking ``floor``/``ceil`` of those
gives 28 and 11 where the documented formulas give 29 and 10. These helpers read a float as the shortest
decimal that round-trips to it (``repr``), which is what the user typed, and compute with exact fractions.
"""

from __future__ import annotations

import math
from fractions import Fraction


def _constant_when_compiled(fn):
    """Mark ``fn`` as ``torch.compiler.assume_constant_result`` does, without importing torch._dynamo.

    That decorator imports torch._dynamo (1.4 s of every interpreter's start-up on a CPU) only to set this
    attribute; tests/core/test_compile.py checks that it still sets exactly this one.
    """
    fn._dynamo_marked_constant = True
    return fn


def as_decimal(value: float) -> Fraction:
    """The exact rational value of the decimal literal ``repr(value)`` (``0.29`` -> 29/100)."""
    return Fraction(repr(float(value)))


# Pure functions of Python numbers: torch.compile runs them at trace time instead of tracing Fraction.
@_constant_when_compiled
def floor_of(value: float, times: int, divided_by: int = 1) -> int:
    """``floor(value * times / divided_by)`` with ``value`` read as its decimal literal."""
    return math.floor(as_decimal(value) * times / divided_by)


@_constant_when_compiled
def ceil_of(value: float, times: int, divided_by: int = 1) -> int:
    """``ceil(value * times / divided_by)`` with ``value`` read as its decimal literal."""
    return math.ceil(as_decimal(value) * times / divided_by)
