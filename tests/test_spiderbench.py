"""``redpacket bench credit --spider`` as an operator runs it (a Spider head and three backends of its own
beside the configured MariaDB), with tiny numbers: every side credits exactly what it was given, and the
round trips show the three shard-local steps (``server.money.shardsteps``) beside the one transaction.

Not in the fast tier: it starts ``mariadbd`` processes. Skipped with the reason when ``mariadbd`` or the
Spider plugin is missing, unless REDPACKET_TEST_REQUIRE_SPIDER=1 (then it fails).
"""

from __future__ import annotations

from tests.clustertools import bench
from tests.conftest import fresh_database, need_spider

CREDITS = 300


def test_every_side_of_the_spider_credit_bench_credits_what_it_was_given(
    mysql_url: str, redis_url: str
) -> None:
    need_spider()
    url = fresh_database(mysql_url, "redpacket_test_spiderbench")
    figures, _ = bench(redis_url, url, "credit", "--spider", "--credits", str(CREDITS), "--rounds", "2")
    assert figures["bench"] == "credit-spider" and figures["credits"] == CREDITS
    for side in ("mariadb", "spider1", "spider2", "spider3"):
        assert figures[f"{side}_credited_rounds"] == [CREDITS, CREDITS], (side, figures)  # each round its own
        assert figures[f"{side}_credited_cents"] == 10 * CREDITS, (side, figures)
        assert figures[f"{side}_told_credited"] == CREDITS, (side, figures)
        assert figures[f"{side}_credit_many_500_per_s"] > 0, (side, figures)
    # One transaction a batch on one database; on N shards: the packet's shard, each user shard, the
    # packet's shard again (a batch of one packet's shares to users on every shard).
    assert figures["mariadb_transactions_per_batch"] == 1, figures
    for n in (1, 2, 3):
        assert figures[f"spider{n}_transactions_per_batch"] == n + 2, figures
        assert figures[f"spider{n}_backend_statements_per_batch"] > 0, figures
