"""``python -m sglang.launch_server``, played by the stand-in (see the package docstring)."""

from k26dev.standin.sglang_cli import main

if __name__ == "__main__":
    raise SystemExit(main())
