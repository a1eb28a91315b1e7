"""Development tools for k26-supervisor: never in the product's wheel or package.

A distribution of its own (``devtools/pyproject.toml``, ``k26-dev``), which
``scripts/dev.sh setup`` installs editable beside the product
(``pip install -e ".[dev]" -e ./devtools``), with its command, ``k26-dev``: the
confined systemd sandbox (``sandbox``, ``sandbox_inner``), the booted host
(``bootedhost``, ``deployed``), the demo, and the stand-in SGLang server
(``standin``, with ``standin/sglang_shim``). They unshare namespaces, mount, and
kill the processes they started: the daemon never imports them. Standard
library only where they run as their own processes (the sandbox's inner steps,
the stand-in), so they work in any Python 3.11 interpreter.
"""
