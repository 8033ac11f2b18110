"""Local services started for a test or a benchmark and stopped after it: throw-away ``redis-server``
processes (``throwaway``), a Galera cluster (``galera``) and a Spider head with its backends (``spider``)
of ``mariadbd`` processes. What those two share is written once: one server (``node``), the servers
together (``cluster``), their command (``cli``) and the rest (``mariadbd``). Each also runs from a shell:
``python -m launchers.galera up DIR``, ``python -m launchers.spider up DIR``. Nothing of the system
imports them."""
