"""How ``redpacket bench grab-script`` stubs a Redis command inside the grab script (its ablations), read from
the script it makes."""

from __future__ import annotations

from bench.scriptbench import stubbed


def test_a_stub_shadows_redis_call_for_its_command_and_key_only() -> None:
    lua = stubbed("return redis.call('LLEN', KEYS[2])", ["LLEN shares", "TIME"])
    assert "stubs['LLEN'][KEYS[2]] = function() return 1 end" in lua
    assert "stubs['TIME'][''] = function() return {'" in lua
    assert lua.index("local redis = {call = function(command, ...)") < lua.index("return redis.call('LLEN'")
