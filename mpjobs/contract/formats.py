"""Numbers as the CLI and the dashboard both show them: one rule each, twinned in app/static/js/dom.js.

Both sides round the exact binary value, ties away from zero, as JavaScript's `toPrecision` and
`toFixed` do, so the same number reads the same in a terminal and in a browser.
tests/mpjobs/contract/test_formats.py runs both on one table of values.
"""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Context, Decimal
from typing import Any

_EXACT = Context(prec=1000, rounding=ROUND_HALF_UP)
"""Enough digits for any double, so rounding never loses one before it should."""


def _significant(value: float, digits: int) -> Decimal:
    exact = Decimal(value)
    return exact.quantize(Decimal(1).scaleb(exact.adjusted() - digits + 1), context=_EXACT)


def _positional(value: Decimal) -> str:
    """Never scientific notation, no trailing zeros: Decimal("1.50E+2") -> "150"."""
    return format(value.normalize(_EXACT), "f")


def _whole(value: float) -> str:
    return format(Decimal(value).quantize(Decimal(1), context=_EXACT), "f")


def percent(share: float, sign: bool = False) -> str:
    """A share (0.00053) as a percentage: two significant digits under 10%, whole from 10% up.

    Only an exact 0 reads "0%", and only 100% or more reads "100%" (99.7% reads "99%"). With
    `sign`, a positive value gets a "+", as loss gaps do; a negative one always has its "-".

    >>> percent(0.00053, sign=True), percent(-0.0123), percent(0.25), percent(0.0), percent(0.997)
    ('+0.053%', '-1.2%', '25%', '0%', '99%')
    """
    value = float(share) * 100
    if value == 0:
        return "0%"
    size = abs(value)
    text = _positional(_significant(size, 2)) if size < 10 else _whole(size)
    if text == "100" and size < 100:
        text = "99"
    return f"{'-' if value < 0 else '+' if sign else ''}{text}%"


def number(value: float, digits: int = 4) -> str:
    """`digits` significant digits; scientific below 0.001 and from a million up; whole numbers whole.

    >>> number(2.58149), number(0.000123456), number(1234567.8), number(32768.0)
    ('2.581', '1.235e-4', '1.235e+6', '32768')
    """
    value = float(value)
    if value == 0:
        return "0"
    size = abs(value)
    if value.is_integer() and size < 1e12:  # loss scales are exact powers of two
        return str(int(value))
    rounded = _significant(value, digits)
    if size >= 1e6 or size < 1e-3:
        exponent = rounded.adjusted()
        return f"{_positional(rounded.scaleb(-exponent))}e{exponent:+d}"
    return _positional(rounded)


def rate(value: float) -> str:
    """A rate (examples/s): whole, with thousands separators, from 100 up; three significant digits below.

    >>> rate(14921.7), rate(42.46), rate(0.8125)
    ('14,922', '42.5', '0.813')
    """
    if abs(value) >= 100:
        return f"{int(Decimal(value).quantize(Decimal(1), context=_EXACT)):,}"
    return "0" if value == 0 else _positional(_significant(value, 3))


def ratio(value: float) -> str:
    """A ratio to float32 (step time, speed): two decimals, or two significant digits under 0.1 (never "0.00×").

    >>> ratio(1.3), ratio(0.0456)
    ('1.30×', '0.046×')
    """
    fixed = Decimal(value).quantize(Decimal("0.01"), context=_EXACT)
    return f"{fixed if abs(fixed) >= Decimal('0.1') or value == 0 else _positional(_significant(value, 2))}×"


def ratio_range(low: float, high: float, unit: str = "×") -> str:
    """Two ratios as a range, the sign once at the end.

    >>> ratio_range(0.95, 1.064), ratio_range(0.95, 1.064, unit="")
    ('0.95–1.06×', '0.95–1.06')
    """
    return f"{ratio(low)[:-1]}–{ratio(high)[:-1]}{unit}"


def speed_words(slowdown: float, low: float, high: float, difference: str) -> str:
    """A measured speed against float32 (mpjobs.contract.records.PrecisionSpeed) with its interval, in words.

    `slowdown` is the policy's step time over float32's; `low`-`high` its interval; `difference`
    the measurement's own call ("slower", "faster" or "none"), never re-judged from the figures.

    >>> speed_words(4.2, 3.9, 4.5, "slower")
    '4.20× slower than float32 (3.90–4.50×)'
    >>> speed_words(0.5, 0.4, 0.625, "faster")
    '2.00× faster than float32 (1.60–2.50×)'
    >>> speed_words(1.01, 0.95, 1.06, "none")
    "no measurable speed difference from float32 (step time 0.95–1.06× float32's)"
    """
    if difference == "slower":
        return f"{ratio(slowdown)} slower than float32 ({ratio_range(low, high)})"
    if difference == "faster":
        return f"{ratio(1 / slowdown)} faster than float32 ({ratio_range(1 / high, 1 / low)})"
    return f"no measurable speed difference from float32 (step time {ratio_range(low, high)} float32's)"


def num(value: Any) -> str:
    """A step's value in 4 significant digits; null (a non-finite value in the API) says so."""
    return "non-finite" if value is None else number(value)


def scale_num(value: Any) -> str:
    """Loss scales are powers of two; show them whole (32768, not 3.277e+04)."""
    return "n/a" if value is None else f"{value:.10g}"


def duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds + 0.5), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
