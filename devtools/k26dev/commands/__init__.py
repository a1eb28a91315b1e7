"""The ``k26-dev`` commands, one module each, each exposing ``register(subparsers)``."""
