"""pystemd's setup.py for the package's build: the same modules as upstream's
(pystemd 0.15.3 setup.py: packages, package data, libsystemd's version as a Cython
compile-time constant), compiled from the .pyx sources for CPython's stable ABI
(Py_LIMITED_API 3.11, Cython's limited-API mode) into one ``cp311-abi3`` wheel that
every supported CPython imports: 3.11, 3.12 and 3.13 (debian/python-versions).
debian/rules copies it over the unpacked sdist's setup.py and removes the sdist's
pre-generated C (made for the full API)."""

import subprocess
from pathlib import Path

from Cython.Build import cythonize
from setuptools import setup
from setuptools.extension import Extension

LIMITED_API = "0x030B0000"  # 3.11: the oldest CPython the package supports
libsystemd = int(subprocess.check_output(["pkg-config", "--modversion", "libsystemd"]))
modules = cythonize(
    [
        Extension(
            "*",
            ["pystemd/*.pyx"],
            libraries=["systemd"],
            define_macros=[("CYTHON_LIMITED_API", "1"), ("Py_LIMITED_API", LIMITED_API)],
            py_limited_api=True,
        )
    ],
    compile_time_env={"LIBSYSTEMD_VERSION": libsystemd},
)
setup(
    packages=["pystemd", "pystemd.systemd1", "pystemd.machine1", "pystemd.DBus"],
    ext_modules=modules,
    package_data={
        "pystemd": [str(p.relative_to("pystemd")) for p in Path("pystemd").glob("**/*.pyi")]
    },
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
