"""Builds kforge: the Python package plus the kforge._C extension, compiled by CMake against torch.

    pip install .                               build isolation: pyproject.toml's [build-system]
                                                brings setuptools, wheel, pybind11 and torch 2.11.0
    pip install --no-build-isolation -e .       against the torch already installed (make install)
    python setup.py build_ext --inplace         the extension next to the sources (no pip)
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def read_version() -> str:
    """kforge's version, written once in python/kforge/_version.py (read as text: importing kforge
    here would need the extension this script builds)."""
    text = (ROOT / "python" / "kforge" / "_version.py").read_text(encoding="utf-8")
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11
        import torch

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = [
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path};{pybind11.get_cmake_dir()}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DKFORGE_OUTPUT_DIR={out_dir}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if shutil.which("ninja"):
            cfg.append("-GNinja")
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 2))
        subprocess.check_call(["cmake", "-S", str(ROOT), "-B", str(build_dir), *cfg])
        subprocess.check_call(["cmake", "--build", str(build_dir), "-j", jobs])


class BuildPy(build_py):
    """Ship kernels_src/ inside the package so an installed kforge finds its kernel sources."""

    def run(self) -> None:
        super().run()
        dest = Path(self.build_lib) / "kforge" / "kernels_src"
        dest.mkdir(parents=True, exist_ok=True)
        for f in (ROOT / "kernels_src").iterdir():
            if f.suffix in (".cu", ".cuh"):
                shutil.copy2(f, dest / f.name)


setup(
    name="kforge",
    version=read_version(),
    description="JIT-compiled llm.c-style CUDA kernels as a Lightning Thunder executor",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="MIT",
    license_files=["LICENSE"],
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: C++",
        "Environment :: GPU :: NVIDIA CUDA",
        "Operating System :: POSIX :: Linux",
    ],
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[CMakeExtension("kforge._C")],
    cmdclass={"build_ext": CMakeBuild, "build_py": BuildPy},
    python_requires=">=3.10",
    install_requires=["torch==2.11.0", "lightning-thunder==0.2.6", "tabulate", "tqdm"],
    # Charts of `python -m kforge bench report` / `bench ops --plot`: pip install "kforge[plot]".
    extras_require={"plot": ["matplotlib"]},
    zip_safe=False,
)
