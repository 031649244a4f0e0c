"""The contract tier: every test here reads the pinned engine wheels from the user cache
(`make contract-wheels` puts them there; the tests never download)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent.name == "contract":
            item.add_marker(pytest.mark.contract)
