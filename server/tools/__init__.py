"""The Python client of the hub's protocol: one connection (``client``) and the app's client that
reconnects and recovers on top of it (``reconnecting``). Nothing of the system imports them."""
