"""Build hook of the wheel (pyproject.toml says why setuptools): stage libexpseg.so, the
`expseg` and `expseg-ipc-check` binaries and the launchers into expseg/_lib/, and tag the
wheel for the platform, not for a Python version (nothing in it is a Python extension).

Environment:
  EXPSEG_PREBUILT=DIR     take libexpseg.so, expseg, expseg-ipc-check from DIR (no cargo)
  EXPSEG_WHEEL_PLAT=TAG   the wheel's platform tag (scripts/build-portable.sh: manylinux_2_28_x86_64)
  CARGO_TARGET_DIR        where cargo builds (default: target/)
"""

import os
import re
import shutil
import stat
import subprocess

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
BINARIES = ["libexpseg.so", "expseg", "expseg-ipc-check"]
SCRIPTS = ["expseg-run", "expseg-srun", "expseg-report-merge", "expseg.sbatch"]


def cargo_version():
    text = open(os.path.join(ROOT, "Cargo.toml"), encoding="utf-8").read()
    package = text.split("[package]", 1)[1].split("\n[", 1)[0]
    return re.search(r'^version\s*=\s*"([^"]+)"', package, re.M).group(1)


def built_binaries():
    prebuilt = os.environ.get("EXPSEG_PREBUILT")
    if prebuilt:
        return prebuilt
    if shutil.which("cargo") is None:
        raise SystemExit(
            "expseg: building from source needs cargo (https://rustup.rs); on machines without "
            "it, install a prebuilt wheel (scripts/build-portable.sh makes one)"
        )
    subprocess.check_call(["cargo", "build", "--release", "--bins", "--lib"], cwd=ROOT)
    target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target")
    return os.path.join(target, "release")


class BuildWithCargo(build_py):
    def run(self):
        super().run()
        dest = os.path.join(self.build_lib, "expseg", "_lib")
        os.makedirs(dest, exist_ok=True)
        src = built_binaries()
        for name in BINARIES:
            path = os.path.join(src, name)
            if not os.path.isfile(path):
                raise SystemExit(f"expseg: {path} is missing")
            self.copy_file(path, os.path.join(dest, name))
        for name in SCRIPTS:
            self.copy_file(os.path.join(ROOT, "scripts", name), os.path.join(dest, name))
        for name in BINARIES + SCRIPTS:
            p = os.path.join(dest, name)
            os.chmod(p, os.stat(p).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        with open(os.path.join(self.build_lib, "expseg", "_version.py"), "w") as f:
            f.write(f'__version__ = "{cargo_version()}"\n')


class BinaryDistribution(Distribution):
    """Platform files: installed to platlib, and the wheel is not pure."""

    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", os.environ.get("EXPSEG_WHEEL_PLAT") or plat


setup(
    version=cargo_version(),
    distclass=BinaryDistribution,
    cmdclass={"build_py": BuildWithCargo, "bdist_wheel": PlatformWheel},
)
