"""The benchmarks and the Locust load, apart from the system they measure: each ``*bench.py`` module is
one ``redpacket bench`` measurement, ``load`` (with its plan, users and locustfile) is ``redpacket load``,
and ``report``, ``plots``, ``progress`` and ``hotclient`` serve them. Installed with the ``tools`` extra;
nothing of the system imports them, the ``redpacket`` command (``server.cli``) starts them."""
