"""k26-supervisor: keeps SGLang inference units honest.

The package is split into a pure core (classifier, state machine, policy,
config models) and thin adapters for I/O (systemd over D-Bus, the inference
server over HTTP, the serving venv through subprocesses).
"""

__version__ = "0.1.0"
