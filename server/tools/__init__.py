"""Tools around the system, apart from the code they measure: the benchmarks, the Locust load, plots and
progress, a Python client of the protocol. Nothing of the system imports them; the ``redpacket`` command
(``server.cli``) starts them."""
