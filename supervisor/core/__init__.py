"""The pure core: what a unit's life is, what its exits mean, what the daemon shows.

Nothing here does I/O or imports anything that does (no asyncio, subprocess,
sockets, D-Bus, HTTP): events in, decisions out, so every rule is tested with
no processes at all. ``tests/unit/core/test_purity.py`` holds the line.
"""
