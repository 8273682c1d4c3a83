"""Sizes as a person reads them: "300 MB" rather than "0 GB" for what is under a gigabyte."""

from __future__ import annotations

from django import template

register = template.Library()

MB_PER_GB = 1024


@register.filter
def gb_size(gb) -> str:
    """A size given in GB: MB below a gigabyte, GB (one decimal where it has one) above; "0 GB" for nothing."""
    try:
        gb = float(gb)
    except (TypeError, ValueError):
        return ""
    if gb <= 0:
        return "0 GB"
    if gb < 1:
        return f"{max(1, round(gb * MB_PER_GB))} MB"
    rounded = round(gb, 1)
    return f"{rounded:g} GB" if rounded < 1000 else f"{round(gb):,} GB"


@register.filter
def bytes_size(n) -> str:
    """A size given in bytes, as gb_size says it."""
    try:
        return gb_size(int(n) / MB_PER_GB**3)
    except (TypeError, ValueError):
        return ""


@register.simple_tag
def placed_of(placed, total) -> str:
    """ "60 of 80 GB", or "300 MB of 24 GB" when what is placed is under a gigabyte."""
    placed_text, total_text = gb_size(placed), gb_size(total)
    if placed_text.endswith(" GB") and total_text.endswith(" GB"):
        return f"{placed_text[:-3]} of {total_text}"
    return f"{placed_text} of {total_text}"
