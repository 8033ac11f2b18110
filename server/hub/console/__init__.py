"""The operators' console: a packet's whole life, a user's money and the books on one page, served beside
the metrics (``server.hub.operations``), behind the operators' own key (``sessions``). Its API
(``/api/console/*``, in docs/openapi.json; ``api``) reads what the ledger, Redis and the hubs hold
(``views``, ``books``); its one write lifts a block or a throttle."""
