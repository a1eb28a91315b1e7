"""Unit-test plumbing: the JIT caches are the run's own, never the user's.

The stand-in writes Triton and inductor kernels where the real server would,
and with no cache variable set that is ``~/.triton/cache`` and
``$TMPDIR/torchinductor_<user>``: a developer's own caches. Every unit test, and
every process it starts, gets them pinned under one directory of the session's
instead, unless the test sets them itself. (The integration tests pin them per
unit, as the shipped units do.)
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from supervisor.core.jit_caches import CACHE_ENV

CACHE_VARS = tuple(CACHE_ENV.values())  # every JIT cache the product knows


@pytest.fixture(autouse=True, scope="session")
def _own_jit_caches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    base = tmp_path_factory.mktemp("jit-caches")
    with pytest.MonkeyPatch.context() as patch:
        for var in CACHE_VARS:
            patch.setenv(var, str(base / var.lower()))
        yield
