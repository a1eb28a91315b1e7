"""Build, on this GPU-less machine, everything the GPU check carries (bench/gpu/.work/).

    .venv/bin/python bench/gpu/prepare.py [--arch 9.0] [--gpu-python-version 3.12]

1. `k26-supervisor flashinfer warm` (the product's own warm-up) precompiles FlashInfer's
   `sampling` module for --arch into .work/cache in the serving venv .cache/serving-0.7,
   with its k26-build.env; then `flashinfer doctor` must say warm (exit 0).
2. Wheels the GPU host lacks, for its Python (cp312 on the lent H200 image): apache-tvm-ffi,
   at the serving venv's version. That alone loads the module.
3. For the cold JIT build there: flashinfer-python's own files, byte-identical to its wheel, but
   only what a `sampling` build reads (all its Python, the header trees on the include path, the
   top-level csrc headers and the three .cu sources, the dist-info). The full 0.7.4 wheel is
   101 MB and the device tool carries 64 MiB in all.
4. .work/prepare.json: versions here, warm and doctor output, sizes and sha256 of what travels.

Everything lands under bench/gpu/.work/ (git-ignored); carry that one path.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORK = HERE / ".work"
DOWNLOADS = HERE / ".downloads"  # not carried
VENV = ROOT / ".cache" / "serving-0.7"
CLI = ROOT / ".venv" / "bin" / "k26-supervisor"

DATA_TREES = (
    "flashinfer/data/include/",
    "flashinfer/data/cccl/cub/",
    "flashinfer/data/cccl/libcudacxx/include/",
    "flashinfer/data/cccl/thrust/",
    "flashinfer/data/cutlass/include/",
    "flashinfer/data/cutlass/tools/util/include/",
    "flashinfer/data/spdlog/include/",
)
SAMPLING_SOURCES = ("sampling.cu", "renorm.cu", "flashinfer_sampling_binding.cu")


def keep(name: str) -> bool:
    if ".dist-info/" in name:
        return True
    if name.startswith("flashinfer/data/csrc/"):
        rest = name[len("flashinfer/data/csrc/") :]
        return "/" not in rest and (rest in SAMPLING_SOURCES or rest.endswith((".h", ".cuh")))
    if name.startswith(DATA_TREES):
        return True
    return (
        name.startswith("flashinfer/")
        and not name.startswith("flashinfer/data/")
        and name.endswith(".py")
    )


def pip_download(spec: str, dest: Path, extra: list[str]) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    name = spec.split("==")[0].replace("-", "_")
    version = spec.split("==")[1]
    have = sorted(dest.glob(f"{name}-{version}-*.whl"))
    if not have:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "-d", str(dest), *extra, spec], check=True)  # fmt: skip
        have = sorted(dest.glob(f"{name}-{version}-*.whl"))
    if len(have) != 1:
        raise SystemExit(f"expected one wheel for {spec} in {dest}, found {have}")
    return have[0]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def subset_tarball(wheel: Path, out: Path) -> dict[str, object]:
    """A tar.xz of the kept wheel members, each checked against the wheel's RECORD."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        record_name = next(n for n in names if n.endswith(".dist-info/RECORD"))
        record = {
            row[0]: row[1]
            for row in csv.reader(io.StringIO(zf.read(record_name).decode()))
            if len(row) > 1
        }
        kept = [n for n in names if keep(n) and not n.endswith("/")]
        raw = 0
        with tarfile.open(out, "w:xz", preset=6) as tar:
            for name in kept:
                data = zf.read(name)
                want = record.get(name, "")
                if want.startswith("sha256="):
                    got = (
                        base64.urlsafe_b64encode(hashlib.sha256(data).digest())
                        .rstrip(b"=")
                        .decode()
                    )
                    if got != want[len("sha256=") :]:
                        raise SystemExit(f"{name}: sha256 differs from RECORD")
                info = tarfile.TarInfo(name)
                info.size = len(data)
                info.mtime = int(time.mktime((*zf.getinfo(name).date_time, 0, 0, -1)))
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(data))
                raw += len(data)
    return {"wheel": wheel.name, "wheel_bytes": wheel.stat().st_size, "wheel_members": len(names),
            "kept_members": len(kept), "kept_raw_bytes": raw, "tarball": out.name,
            "tarball_bytes": out.stat().st_size, "tarball_sha256": sha256(out)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="9.0")
    parser.add_argument("--gpu-python-version", default="3.12")
    args = parser.parse_args()
    WORK.mkdir(exist_ok=True)
    workspace = WORK / "cache"
    env_file = VENV / "k26-build.env"
    common = ["--python", str(VENV / "bin" / "python"), "--arch", args.arch,
              "--workspace", str(workspace), "--env-file", str(env_file)]  # fmt: skip
    report: dict[str, object] = {"arch": args.arch, "workspace": str(workspace)}

    started = time.perf_counter()
    warm = subprocess.run([str(CLI), "flashinfer", "warm", *common, "--timeout", "1500"],
                          capture_output=True, text=True)  # fmt: skip
    report["warm"] = {"rc": warm.returncode, "wall_s": round(time.perf_counter() - started, 1),
                      "stdout": warm.stdout.strip().splitlines()[-3:],
                      "stderr_tail": warm.stderr.strip().splitlines()[-4:]}  # fmt: skip
    doctor = subprocess.run([str(CLI), "flashinfer", "doctor", *common, "--json"],
                            capture_output=True, text=True)  # fmt: skip
    report["doctor_rc"] = doctor.returncode
    report["doctor"] = (
        json.loads(doctor.stdout) if doctor.stdout.strip().startswith("{") else doctor.stdout
    )
    if warm.returncode != 0 or doctor.returncode != 0:
        print(json.dumps(report, indent=1), file=sys.stderr)
        raise SystemExit("warm-up or doctor failed")

    site = next((VENV / "lib").glob("python3.*/site-packages"))
    tvm_version = (
        next(site.glob("apache_tvm_ffi-*.dist-info")).name.removesuffix(".dist-info").split("-")[1]
    )
    fi_version = (
        next(site.glob("flashinfer_python-*.dist-info"))
        .name.removesuffix(".dist-info")
        .split("-")[1]
    )
    platforms = ["--python-version", args.gpu_python_version, "--implementation", "cp"]
    for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                "manylinux_2_17_x86_64", "manylinux2014_x86_64"):  # fmt: skip
        platforms += ["--platform", tag]
    tvm_wheel = pip_download(f"apache-tvm-ffi=={tvm_version}", WORK / "whl", platforms)
    fi_wheel = pip_download(f"flashinfer-python=={fi_version}", DOWNLOADS, [])
    tarball = WORK / f"flashinfer_python-{fi_version}-sampling-subset.tar.xz"
    report["tvm_ffi_wheel"] = {
        "file": tvm_wheel.name,
        "bytes": tvm_wheel.stat().st_size,
        "sha256": sha256(tvm_wheel),
    }
    report["flashinfer_subset"] = subset_tarball(fi_wheel, tarball)

    carried = sum(p.stat().st_size for p in WORK.rglob("*") if p.is_file())
    report["carried_bytes"] = carried
    (WORK / "prepare.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "doctor"}, indent=1))
    print(f"carry bench/gpu/.work ({carried / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
