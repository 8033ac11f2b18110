"""What hubs and workers both do to a group's live state in Redis: its event stream (``events``), the
announcement of packets (``announce``), and the bot detector (``botscore``, pure; ``bots``, its I/O)."""
