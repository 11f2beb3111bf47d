"""Build and install asap_comm (and the reference model package asap_models).

The native core in kernels/ is built by CMakeLists.txt; this file only drives
CMake. It needs a C++20 compiler (g++ >= 10 or clang >= 12), CMake >= 3.18 and
pybind11; pip brings the last two into the isolated build environment
(pyproject.toml).
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        cxx = os.environ.get("CXX")
        if cxx is not None and shutil.which(cxx) is None:
            raise RuntimeError(f"asap_comm: $CXX={cxx!r} is not an executable compiler; unset it or point it at g++.")
        if cxx is None and shutil.which("c++") is None and shutil.which("g++") is None:
            raise RuntimeError(
                "asap_comm: no C++ compiler found (looked for $CXX, c++ and g++). "
                "Install one, e.g. `apt-get install g++` (Debian/Ubuntu), then rerun pip install."
            )
        cmake = shutil.which("cmake")
        if cmake is None:
            raise RuntimeError("asap_comm: cmake not found: `pip install cmake` or `apt-get install cmake`.")
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        jobs = str(max(1, os.cpu_count() or 1))
        try:
            subprocess.run([cmake, "-S", str(ROOT), "-B", str(build_dir), *cfg], check=True)
            subprocess.run([cmake, "--build", str(build_dir), "-j", jobs], check=True)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(
                f"asap_comm: building the native core failed ({' '.join(map(str, e.cmd))} exited "
                f"{e.returncode}); see the compiler output above. It needs a C++20 compiler "
                "(g++ >= 10), CMake >= 3.18 and pybind11."
            ) from None


setup(
    ext_modules=[CMakeExtension("asap_comm._C")],
    cmdclass={"build_ext": CMakeBuild},
)
