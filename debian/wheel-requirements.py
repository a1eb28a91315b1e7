"""``python3 debian/wheel-requirements.py DIR``: a pip requirements file, on stdout,
that pins every wheel in DIR to its version and sha256 (``--require-hashes``). The
package's postinst installs the daemon's venv with it, offline, from the wheels the
package carries (debian/rules makes one file per supported CPython)."""

import hashlib
import re
import sys
from pathlib import Path


def main(directory: str) -> int:
    wheels = sorted(Path(directory).glob("*.whl"))
    if not wheels:
        print(f"wheel-requirements: no wheels in {directory}", file=sys.stderr)
        return 1
    for wheel in wheels:
        name, version = wheel.name.split("-")[:2]
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        print(f"{re.sub(r'[-_.]+', '-', name).lower()}=={version} --hash=sha256:{digest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
