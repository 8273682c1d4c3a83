"""A Limiter of its own on the tests' Redis, and what its admissions came to (the limits' tests share these)."""

from __future__ import annotations


def run_limiter(work):
    """`work(limiter, tag)` on a fresh event loop, with a Limiter of its own on the tests' Redis; and the key's hash."""
    import asyncio
    import secrets

    from gateway.limits import Limiter, tag_of

    key_hash = secrets.token_hex(32)

    async def go():
        limiter = Limiter()
        try:
            return await work(limiter, tag_of(key_hash))
        finally:
            await limiter.close()

    return asyncio.run(go()), key_hash


def outcomes(results) -> list[str]:
    from gateway.errors import Refusal

    return ["refused" if isinstance(r, Refusal) else "admitted" if r is not None else "unchecked" for r in results]
