"""Each engine test may start apirctl's own podman service in its home; stop it afterwards."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _stop_own_service(isolated_home: object) -> Iterator[None]:
    yield
    from apirctl import engine

    engine.stop_service()
