"""The money core: how a packet is split, paid for (packets), grabbed and opened (grabs), credited,
settled and reconciled, and who may receive it (groups and their members). Imports the store and the
shared modules, never the hub, the worker or the tools (tests/unit/test_layout.py keeps it so)."""
