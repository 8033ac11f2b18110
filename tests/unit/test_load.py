"""The pure arithmetic of ``redpacket load``'s plan and report (``bench.loadplan``): stages, percentiles
from buckets, the knee, and the server frames its client reads. (A short run against a real ``redpacket
up``: ``tests/test_load.py``.)"""

from __future__ import annotations

import pytest

from bench.loadplan import (
    StageFigures,
    bucket_quantile,
    knee,
    parse_stages,
    percentile,
    stage_at,
    subtract,
)


def test_stages_parse_to_end_times_and_refuse_nonsense() -> None:
    stages = parse_stages("10:5, 20:2.5,40:10")
    assert [(s.users, s.ends_at) for s in stages] == [(10, 5.0), (20, 7.5), (40, 17.5)]
    assert [stage_at(stages, t) for t in (0, 4.9, 5, 17.4, 17.5)] == [0, 0, 1, 2, None]
    for bad in ("", "10", "10:0", "0:5", "a:5", "10:-1", "10:nan"):
        with pytest.raises(ValueError):
            parse_stages(bad)


def test_percentiles_of_counts_and_of_prometheus_buckets() -> None:
    counts = {5: 50, 10: 40, 200: 10}
    assert percentile(counts, 0.5) == 5
    assert percentile(counts, 0.9) == 10
    assert percentile(counts, 0.99) == 200
    assert percentile({}, 0.99) == 0
    assert subtract({5: 60, 10: 40}, {5: 50, 10: 40}) == {5: 10}
    # 100 samples: 90 at or below 0.1, all 100 at or below 1.0 → P99 interpolated in (0.1, 1.0].
    q = bucket_quantile([(0.1, 90), (1.0, 100), (float("inf"), 100)], 0.99)
    assert q is not None and abs(q - 0.91) < 1e-9
    assert bucket_quantile([(0.1, 0), (float("inf"), 0)], 0.99) is None
    assert bucket_quantile([(0.1, 5), (float("inf"), 10)], 0.99) == 0.1  # beyond the last bound


def _stage(
    users: int, grabs: int, p99: float, failures: int = 0, offered: int = 0, sends: int = 0
) -> StageFigures:
    return StageFigures(
        users=users,
        seconds=10,
        requests=grabs + 100,
        failures=failures,
        grabs=grabs,
        grab_p99_ms=p99,
        offered=offered,
        sends=sends,
    )


def test_the_knee_is_where_p99_errors_or_throughput_turn() -> None:
    assert knee([_stage(100, 1000, 20), _stage(200, 2000, 25), _stage(400, 4000, 30)])[0] is None
    assert knee([_stage(100, 1000, 60), _stage(200, 2000, 130)])[0] == 1  # P99 over 2× and over 100 ms
    assert knee([_stage(100, 1000, 20), _stage(200, 2000, 90)])[0] is None  # 4.5× but under the floor
    assert knee([_stage(100, 1000, 20), _stage(200, 2000, 25, failures=50)])[0] == 1  # 2.3% errors
    assert knee([_stage(100, 1000, 20), _stage(200, 1050, 25)])[0] == 1  # throughput flat
    assert knee([])[0] is None


def test_flat_throughput_is_the_loads_limit_when_the_load_offered_no_more() -> None:
    """Before: "grabs/s 28 did not grow with the users (200 → 300)" at 14 % hub CPU, when three admins
    sending every 10 s offered no more grabs."""
    at, why = knee([_stage(200, 280, 20, offered=285), _stage(300, 290, 22, offered=295)])
    assert at is None and "the load was the limit from 300 users" in why and "--send-every" in why, why
    at, why = knee([_stage(200, 280, 20, offered=285), _stage(300, 290, 22, offered=600)])
    assert at == 1 and "while the grabs offered did (28 → 60/s)" in why, why
    # Offered flat while the admins sent more: the packets were not delivered — the system's knee.
    flat_but_sent = [_stage(200, 280, 20, offered=285, sends=20), _stage(300, 290, 22, offered=290, sends=30)]
    assert knee(flat_but_sent)[0] == 1


def test_server_frames_are_parsed_whole_and_partial_ones_left_for_later() -> None:
    from bench.loadplan import server_frames

    small = bytes([0x82, 3]) + b"abc"
    mid = bytes([0x82, 126]) + (300).to_bytes(2, "big") + b"x" * 300
    big = bytes([0x82, 127]) + (70_000).to_bytes(8, "big") + b"y" * 70_000
    ping = bytes([0x89, 0])
    stream = small + mid + big + ping
    assert server_frames(stream) == (
        [(2, b"abc"), (2, b"x" * 300), (2, b"y" * 70_000), (9, b"")],
        len(stream),
    )
    for cut in (1, 3, 6, len(small) + 3, len(small) + len(mid) + 9, len(stream) - 1):
        frames, used = server_frames(stream[:cut])
        rest, more = server_frames(stream[used:])
        assert frames + rest == server_frames(stream)[0] and used + more == len(stream)
