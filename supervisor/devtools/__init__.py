"""Development tools that ship with the package but are not the daemon.

The confined systemd sandbox (``sandbox``, ``sandbox_inner``), the demo, and
the stand-in SGLang server. They unshare namespaces, mount, and kill the
processes they started: the daemon never imports them. Standard library only
where they run as their own processes (the sandbox's inner steps, the
stand-in), so they work in any Python 3.11 interpreter.
"""
