"""Build of the optional compiled extensions ``fastpath._strides``, ``_dispatch``, ``_redist``,
``_pool``, ``_kernels``.

Everything else (metadata, packages, dependencies) lives in ``pyproject.toml``. The
extension is optional: when Cython or the C compiler fails, the build prints a warning
and installs the pure-Python package, which runs on the Python path. Set
``DTENSOR_NO_EXT=1`` to skip the extension on purpose.
"""

from __future__ import annotations

import glob
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import BaseError, CCompilerError

# What a missing or failing C compiler raises (distutils errors, compiler errors, exec).
BUILD_ERRORS = (BaseError, CCompilerError, OSError)

EXT_SOURCE = os.path.join("fastpath", "_strides.pyx")
# the parts ``fastpath/_dispatch.pyx`` includes (next to it, where Cython looks first) and the
# declarations it cimports
DISPATCH_PARTS = sorted(glob.glob(os.path.join("fastpath", "_dispatch_*.pxi"))) + [
    os.path.join("fastpath", name) for name in ("_kernels.pxd", "_redist.pxd")
]
# numpy's C API without the deprecated names
NPY_API = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
# the C loops ``fastpath/_kernels.pyx`` includes
KERNEL_PARTS = [os.path.join("fastpath", "_kernels_simd.pxi")]
# Flags of ``fastpath._kernels`` for GCC-compatible compilers. -O3 vectorises its loops;
# -fno-trapping-math lets the compiler evaluate both sides of a select (x86-64's baseline
# SSE2 has no other way to vectorise them). Neither changes a result: IEEE semantics (NaN,
# inf, -0.0, subnormals, rounding) stay; only floating-point exception flags, which nothing
# reads after these loops, may differ. -fno-math-errno lets sqrt (Adam's step) be the vector
# instruction: nothing reads errno either. No machine-specific flag: the loops pick the CPU's
# vector width at load time (target_clones in ``_kernels_simd.pxi``).
KERNEL_FLAGS = ["-O3", "-fno-trapping-math", "-fno-math-errno"]


def _warn(reason: str) -> None:
    bar = "=" * 78
    sys.stderr.write(
        f"\n{bar}\nWARNING: the compiled extension fastpath._strides was NOT built:\n"
        f"  {reason}\n"
        "dtensor is installed without it and runs on the (slower) Python path.\n"
        "Install a C compiler (and Python headers) and reinstall to get it.\n"
        f"{bar}\n\n"
    )


def _extensions() -> list[Extension]:
    if os.environ.get("DTENSOR_NO_EXT", "0") not in ("", "0"):
        _warn("DTENSOR_NO_EXT is set")
        return []
    try:
        import numpy
        from Cython.Build import cythonize
        from Cython.Compiler.Errors import PyrexError
    except ImportError as exc:
        _warn(f"Cython or numpy is not available ({exc})")
        return []
    try:
        return cythonize(
            [
                Extension("fastpath._strides", [EXT_SOURCE]),
                Extension(
                    "fastpath._redist",
                    [os.path.join("fastpath", "_redist.pyx")],
                    depends=[os.path.join("fastpath", "_redist.pxd")],
                    include_dirs=[numpy.get_include()],
                    define_macros=NPY_API,
                ),
                Extension(
                    "fastpath._dispatch",
                    [os.path.join("fastpath", "_dispatch.pyx")],
                    depends=DISPATCH_PARTS,
                    include_dirs=[numpy.get_include()],
                    define_macros=NPY_API,
                ),
                Extension(
                    "fastpath._pool",
                    [os.path.join("fastpath", "_pool.pyx")],
                    include_dirs=[numpy.get_include()],
                    define_macros=NPY_API,
                ),
                Extension(
                    "fastpath._kernels",
                    [os.path.join("fastpath", "_kernels.pyx")],
                    depends=KERNEL_PARTS,
                    include_dirs=[numpy.get_include()],
                    define_macros=NPY_API,
                ),
            ],
            compiler_directives={"language_level": "3"},
        )
    except (PyrexError, OSError) as exc:
        _warn(f"Cython failed on {EXT_SOURCE} ({exc})")
        return []


class OptionalBuildExt(build_ext):
    """``build_ext`` that turns a failed C compilation into a warning."""

    def run(self) -> None:
        try:
            super().run()
        except BUILD_ERRORS as exc:
            _warn(f"build_ext failed ({type(exc).__name__}: {exc})")

    def build_extension(self, ext: Extension) -> None:
        if ext.name == "fastpath._kernels" and self.compiler.compiler_type == "unix":
            ext.extra_compile_args = [*ext.extra_compile_args, *KERNEL_FLAGS]
        try:
            super().build_extension(ext)
        except BUILD_ERRORS as exc:
            _warn(f"compiling {ext.name} failed ({type(exc).__name__}: {exc})")


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
