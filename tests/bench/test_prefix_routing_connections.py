"""``bench.prefix_routing``'s per-connection arms: clients' keep-alive connections to the
gateway processes (``ClientConnections``)."""

from __future__ import annotations

import random
from pathlib import Path

from bench import prefix_routing
from bench.prefix_routing import ClientConnections


def test_one_connection_per_client_pins_each_client_to_one_process() -> None:
    conns = ClientConnections(4, random.Random(1), pool=1)
    seen: dict[int, set[int]] = {}
    for i in range(200):
        client = i % 10
        c = conns.acquire(client, float(i))
        seen.setdefault(client, set()).add(c.process)
        conns.release(c, float(i))
    assert all(len(p) == 1 for p in seen.values())
    assert len({next(iter(p)) for p in seen.values()}) > 1  # clients drawn independently
    assert conns.opened == 10
    assert conns.requests == 200


def test_a_pool_of_k_uses_at_most_k_connections_and_recycles_after_n_requests() -> None:
    conns = ClientConnections(4, random.Random(2), pool=3)
    used = {id(conns.acquire(0, 0.0)) for _ in range(60)}
    assert len(used) == 3
    assert conns.opened == 3
    recycled = ClientConnections(4, random.Random(2), pool=3, recycle=5)
    for _ in range(60):
        c = recycled.acquire(0, 0.0)
        assert c.uses <= 5
    # 60 requests at 5 a connection: 12 connections, the last 3 maybe not yet full
    assert 12 <= recycled.opened <= 14


def test_pool_connection_idle_past_keepalive_is_reopened() -> None:
    conns = ClientConnections(4, random.Random(3), pool=1, keepalive_s=5.0)
    c = conns.acquire(0, 0.0)
    conns.release(c, 1.0)
    assert conns.acquire(0, 5.5) is c  # idle 4.5 s
    conns.release(c, 6.0)
    assert conns.acquire(0, 11.5) is not c  # idle 5.5 s
    assert conns.opened == 2


def test_sdk_pool_reuses_the_first_idle_connection_and_opens_one_when_all_are_busy() -> None:
    conns = ClientConnections(4, random.Random(4), keepalive_s=5.0)
    a = conns.acquire(0, 0.0)
    b = conns.acquire(0, 0.1)  # a is busy: a second connection
    c = conns.acquire(0, 0.2)
    assert len({id(a), id(b), id(c)}) == 3
    conns.release(c, 1.0)
    conns.release(a, 1.1)
    assert conns.acquire(0, 1.2) is a  # the first opened of the idle ones, not the latest
    conns.release(a, 2.0)
    conns.release(b, 2.0)
    # b and c idle past the keep-alive are closed; a, used at 2.0, is kept
    assert conns.acquire(0, 6.5) is a
    d = conns.acquire(0, 7.5)
    assert d is not b and d is not c
    assert conns.opened == 4


def test_connection_arms_run(tmp_path: Path) -> None:
    out = tmp_path / "conn.md"
    argv = ["--connection-arms", "--sizes", "2", "--duration", "25", "--pools", "1,2"]
    assert prefix_routing.main([*argv, "--out", str(out)]) == 0
    text = out.read_text()
    for label in (
        "| 2 | 2 gateways, per request |",
        "| 2 | 2 gateways, per connection, 1 per client |",
        "| 2 | 2 gateways, per connection, 2 per client |",
        "| 2 | 2 gateways, per connection, openai SDK pool (first idle, 5 s keep-alive) |",
        "| 2 | 2 gateways, per connection, an openai SDK pool per conversation |",
        "| 2 | perfect affinity (tenant pinned) |",
    ):
        assert label in text
    assert "| connections opened | requests per connection | later turns through" in text
    # one client connection per tenant: a conversation's turns all through one process
    one = "| 2 | 2 gateways, per connection, 1 per client | 4 | "
    assert next(r for r in text.splitlines() if r.startswith(one)).endswith("| 100% |")
