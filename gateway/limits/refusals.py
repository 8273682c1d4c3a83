"""The 429 a limit or a budget answers: the sentence the client reads, Retry-After, and OpenAI's x-ratelimit headers."""

from __future__ import annotations

import time
from datetime import datetime
from decimal import Decimal

from ..errors import Refusal
from .windows import MICRO, TEAM_WHAT, WHAT, Budget, Limits, Windows, zone


def duration(seconds: float) -> str:
    """OpenAI's spelling of a reset time: 1s, 6m0s, 2h3m4s."""
    whole = max(1, int(seconds + 0.999))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def money(micro: int) -> str:
    """Micro-units of the prices' currency as an amount: 12.5, 0.000125."""
    text = f"{Decimal(micro) / MICRO:f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def team_refusal(budget: Budget, which: int, used: list[int], windows: Windows, wanted: tuple[int, int]) -> Refusal:
    """The 429 for the team's budget `which` (6-10, as the scripts answer)."""
    name, unit = TEAM_WHAT[which]
    limit = budget.values()[which - 6]
    retry = windows.resets()[{6: 0, 7: 0, 8: 1, 9: 2, 10: 2}[which]]
    at = datetime.fromtimestamp(time.time() + retry, zone()).strftime("%Y-%m-%d %H:%M %Z")
    when = f"it resets in {duration(retry)} (at {at})"
    if which == 10:
        spent = f"{money(used[which])} spent or reserved this month"
        sentence = f"The team {budget.team} is over its monthly spend budget of {money(limit)}: {spent}"
        if wanted[1]:
            sentence += f", and this request may cost {money(wanted[1])} (its prompt by its size, and its max_tokens)"
    else:
        sentence = f"The team {budget.team} is over its budget of {limit} {name}: {used[which]} {unit} used"
        if which in (7, 8, 9) and wanted[0]:
            sentence += (
                f" or reserved, and this request may use {wanted[0]} (its prompt by its size, and its max_tokens)"
            )
    sentence += f"; {when}."
    headers = [(b"retry-after", str(max(1, int(retry + 0.999))).encode())]
    return Refusal(429, sentence, kind="rate_limit_error", code="rate_limit_exceeded", headers=headers)


def refusal(limits: Limits, which: int, used: list[int], windows: Windows, wanted: int = 0) -> Refusal:
    """The 429 for the limit `which` (1-5, as the scripts answer), with OpenAI's x-ratelimit headers.

    `wanted`: the tokens a request would have reserved (RESERVE), when that is what did not fit.
    """
    name, unit = WHAT[which]
    limit = limits.values()[which - 1]
    resets = windows.resets()
    if which == 5:
        retry, sentence = 1.0, f"This API key may have {limit} requests in flight at once, and has {used[5]}."
    else:
        retry = resets[{1: 0, 2: 0, 3: 1, 4: 2}[which]]
        if wanted:
            beyond = " more than the whole window" if wanted > limit else ""
            sentence = (
                f"This API key is over its limit of {limit} {name}: {used[which]} {unit} used or reserved in this "
                f"window, and this request may use {wanted}{beyond} (its prompt by its size, and its max_tokens); "
                f"the window resets in {duration(retry)}."
            )
        else:
            sentence = (
                f"This API key is over its limit of {limit} {name}: {used[which]} {unit} used in this window, "
                f"which resets in {duration(retry)}."
            )
    headers = [(b"retry-after", str(max(1, int(retry + 0.999))).encode())]
    if limits.requests_per_minute:
        headers += [
            (b"x-ratelimit-limit-requests", str(limits.requests_per_minute).encode()),
            (b"x-ratelimit-remaining-requests", str(max(0, limits.requests_per_minute - used[1])).encode()),
            (b"x-ratelimit-reset-requests", duration(resets[0]).encode()),
        ]
    # The token window the headers speak of: the one that refused, else the shortest one set.
    token_window = which - 1 if which in (2, 3, 4) else next((i for i in (1, 2, 3) if limits.values()[i]), None)
    if token_window is not None:
        token_limit = limits.values()[token_window]
        headers += [
            (b"x-ratelimit-limit-tokens", str(token_limit).encode()),
            (b"x-ratelimit-remaining-tokens", str(max(0, token_limit - used[token_window + 1])).encode()),
            (b"x-ratelimit-reset-tokens", duration(resets[max(0, token_window - 1)]).encode()),
        ]
    return Refusal(429, sentence, kind="rate_limit_error", code="rate_limit_exceeded", headers=headers)


def refused(limits: Limits, budget: Budget | None, which: int, used, windows: Windows, wanted) -> Refusal:
    if which >= 6:
        return team_refusal(budget, which, used, windows, wanted)
    return refusal(limits, which, used, windows, wanted=wanted[0])
