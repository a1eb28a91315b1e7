"""Not SGLang: the stand-in answering to SGLang's name, for test serving venvs only.

A venv that lists ``devtools/k26dev/standin/sglang_shim`` in a ``.pth`` file
(and ``devtools`` and the checkout, for ``k26dev`` and ``supervisor``)
runs the stand-in for ``python -m sglang.launch_server`` (see
``devtools/k26dev/standin/sglang_cli.py``). Never install it next to SGLang.
"""

__version__ = "0.5.17-standin"
