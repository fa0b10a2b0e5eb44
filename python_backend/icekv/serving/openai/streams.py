"""Async helpers over Triton response streams (text pieces, then a Final), for requests that run
several at once: the choices of ``n``, or a list of prompts."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from icekv.serving.client import Final


async def starting_with(first, pieces: AsyncIterator) -> AsyncIterator:
    """``pieces`` with ``first`` (taken from it already) in front again."""
    try:
        yield first
        if not isinstance(first, Final):
            async for piece in pieces:
                yield piece
    finally:
        await pieces.aclose()


async def gather_closing(awaitables) -> list:
    """Every result; if one fails, the others are cancelled (their Triton requests with them)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merged(streams: list[AsyncIterator]) -> AsyncIterator:
    """(index, piece) of every stream, as they come, until each has given its Final; the first
    failure is raised, and closing this closes every stream."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async for piece in stream:
                await queue.put((i, piece, None))
        except Exception as e:  # noqa: BLE001 (handed to the reader)
            await queue.put((i, None, e))
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        pending = len(streams)
        while pending:
            i, piece, error = await queue.get()
            if error is not None:
                raise error
            pending -= isinstance(piece, Final)
            yield i, piece
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
