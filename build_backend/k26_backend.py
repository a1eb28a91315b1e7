"""The build backend: setuptools, with the development tools in editable installs only.

One distribution, two shapes. A wheel (``python -m build --wheel``, ``pip wheel``,
``pip install .``: what a server or the Debian package gets) holds the daemon and
its CLI, ``supervisor``, and the ``k26-supervisor`` command. An editable install
(``pip install -e .[dev]``: a developer's checkout, the CI venv) adds the
``k26dev`` package and its ``k26-dev`` command (sandbox, booted host, stand-in
SGLang, demo). ``setup.py`` reads the choice from ``K26_BUILD_WITH_DEV``, which
only these hooks set: the editable ones set it, the others clear it, so a
production wheel never carries the development tools whatever the caller's
environment holds.
"""

from __future__ import annotations

import os
from typing import Any

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403 - every other hook as setuptools has it

_FLAG = "K26_BUILD_WITH_DEV"


def _editable() -> None:
    os.environ[_FLAG] = "1"


def _product_only() -> None:
    os.environ.pop(_FLAG, None)


def get_requires_for_build_wheel(config_settings: Any = None) -> list[str]:
    _product_only()
    return _setuptools.get_requires_for_build_wheel(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory: str, config_settings: Any = None) -> str:
    _product_only()
    return _setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def build_wheel(
    wheel_directory: str, config_settings: Any = None, metadata_directory: str | None = None
) -> str:
    _product_only()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory: str, config_settings: Any = None) -> str:
    _product_only()
    return _setuptools.build_sdist(sdist_directory, config_settings)


def get_requires_for_build_editable(config_settings: Any = None) -> list[str]:
    _editable()
    return _setuptools.get_requires_for_build_editable(config_settings)


def prepare_metadata_for_build_editable(
    metadata_directory: str, config_settings: Any = None
) -> str:
    _editable()
    return _setuptools.prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_editable(
    wheel_directory: str, config_settings: Any = None, metadata_directory: str | None = None
) -> str:
    _editable()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
