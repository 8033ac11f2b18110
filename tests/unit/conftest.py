"""The fast tier is this folder: every test here is marked ``unit`` (``pytest -m unit`` runs them all in
seconds), and none needs a service — no Redis, MariaDB, browser or subprocess; modules are tested
in-process, with fakes at the I/O edge (``tests/unit/fakes.py``). A test that needs a service lives in
``tests/`` beside this folder.

The rule holds two ways: ``tests/unit/test_fast_tier.py`` reads every test module (no ``unit`` mark
written by hand anywhere, no service opened here), and the fixtures below stand in for the ones that
reach a service, so a test here that asks for one (``core``, ``hub_settings``, a hub...) fails saying
why.
"""

from __future__ import annotations

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    # Called through the item's own hooks: only for the tests under this folder.
    item.add_marker(pytest.mark.unit)


def _no_service(what: str) -> None:
    pytest.fail(
        f"the fast tier opens no service ({what}): a test that needs one lives in tests/, not tests/unit/"
    )


@pytest.fixture
def redis_url() -> None:
    _no_service("Redis")


@pytest.fixture
def mysql_url() -> None:
    _no_service("MariaDB")


@pytest.fixture
def spider_url() -> None:
    _no_service("a sharded ledger")


@pytest.fixture
def spider() -> None:
    _no_service("a Spider head")


@pytest.fixture
def cluster() -> None:
    _no_service("a Redis Cluster")


@pytest.fixture
def browser() -> None:
    _no_service("a browser")
