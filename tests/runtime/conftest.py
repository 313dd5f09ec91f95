"""Shared fixtures of the runtime tests (the harness, ``bp_rt_harness``, is on the import path).

``session``: an aiohttp client session for the test (60 s per request), closed afterwards."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        yield s
