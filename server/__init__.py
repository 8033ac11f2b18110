"""redpacket: live red packets in group chat.

The money core (settings, errors, split, keys, scripts, ledger, packets) lives here and is imported by the
hub and by the workers in ``worker/``.
"""
