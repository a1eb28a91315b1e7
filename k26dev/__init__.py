"""Development tools for k26-supervisor: never in the product's wheel or package.

``pip install -e .[dev]`` installs this package beside ``supervisor`` (the build
backend in ``build_backend/`` adds it to editable installs only) with its command,
``k26-dev``: the confined systemd sandbox (``sandbox``, ``sandbox_inner``), the
booted host (``bootedhost``, ``deployed``), the demo, and the stand-in SGLang
server (``standin``, with ``standin/sglang_shim``). They unshare namespaces, mount,
and kill the processes they started: the daemon never imports them. Standard
library only where they run as their own processes (the sandbox's inner steps,
the stand-in), so they work in any Python 3.11 interpreter.
"""
