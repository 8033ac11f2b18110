"""Storage plumbing: the database and its schema, every Redis key, the Lua scripts' loader, Redis
servers or a cluster, batching, the queue, the embedded Valkey. Imports nothing of money, hub, worker or
tools."""
