"""Which packages and commands a build holds; everything else is in pyproject.toml.

``build_backend/k26_backend.py`` sets ``K26_BUILD_WITH_DEV`` for editable installs
only: then the development tools (``k26dev``, ``k26-dev``) come too. A wheel holds
the daemon and its CLI alone.
"""

import os

from setuptools import find_namespace_packages, setup

WITH_DEV = os.environ.get("K26_BUILD_WITH_DEV") == "1"

setup(
    packages=find_namespace_packages(include=["supervisor", "supervisor.*"])
    + (find_namespace_packages(include=["k26dev", "k26dev.*"]) if WITH_DEV else []),
    entry_points={
        "console_scripts": [
            "k26-supervisor = supervisor.cli:main",
            *(["k26-dev = k26dev.cli:main"] if WITH_DEV else []),
        ]
    },
)
