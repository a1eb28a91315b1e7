"""Thin adapters between the pure core and the world.

Each one owns one dependency and maps its failures to ``core.errors`` at the
boundary: systemd over D-Bus (``systemd_bus``), the inference server over
HTTP (``probe``), the kernel log, unit output and journal (``evidence``,
``exits``), sd_notify, the read-only HTTP server and its metrics, the config
file, and the FlashInfer warm-up (``warmup``, driving ``supervisor.flashinfer``).
None of them blocks the event loop.
"""
