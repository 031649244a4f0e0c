"""argparse option types shared by every command: each rejects bad input with a message that
says what a good value looks like (argparse prefixes the option's name)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

from batchknee.core.engine_args import human_readable_int
from batchknee.core.units import parse_bandwidth


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def positive_float(text: str) -> float:
    value = _number(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive finite number")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} must be zero or a positive finite number")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be zero or positive")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1)."""
    value = non_negative_float(text)
    if not value < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 0 and below 1")
    return value


def unit_fraction(text: str) -> float:
    """A number in (0, 1]: a share of memory or of peak bandwidth."""
    value = positive_float(text)
    if value > 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} must be in (0, 1]")
    return value


Bounded = TypeVar("Bounded", int, float)


def at_most(parse: Callable[[str], Bounded], limit: float, said: str = "") -> Callable[[str], Bounded]:
    """`parse`, refusing a value over `limit` (`said`: the limit as the message words it)."""

    def bounded(text: str) -> Bounded:
        value = parse(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"{text!r} must be at most {said or f'{limit:g}'}")
        return value

    return bounded


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not within 0..65535")
    return value


def token_count(text: str) -> int:
    """`8192`, `8k`, `32K`, `1G`: vLLM's human-readable counts (--max-model-len, token budgets, bytes)."""
    value = human_readable_int(text)
    if value is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive count (e.g. 8192, 8k = 8,000, 8K = 8,192)"
        )
    return value


def int_list(text: str) -> list[int]:
    """`512,2048,8192` → [512, 2048, 8192], each positive."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list of positive whole numbers")
    return [positive_int(item) for item in items]


def bandwidth(text: str) -> float:
    try:
        return parse_bandwidth(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
