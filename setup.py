"""Build the Cython CPU kernels in cython/ into the freetoken package (freetoken._<name>).

Every cython/<name>.pyx becomes the extension module freetoken._<name>; C helpers named in
cython/<name>.sources (one per line) are compiled beside it. No -march=native: ISA paths are
chosen at run time (see cython/ and freetoken/kernels.py), so a wheel runs on any x86-64.
"""
from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = Path(__file__).parent


def _extensions():
    exts = []
    for pyx in sorted((HERE / "cython").glob("*.pyx")):
        sources = [f"cython/{pyx.name}"]
        listing = pyx.with_suffix(".sources")
        if listing.exists():
            sources += [f"cython/{s.strip()}" for s in listing.read_text().splitlines() if s.strip()]
        exts.append(Extension(
            f"freetoken._{pyx.stem}", sources,
            include_dirs=[numpy.get_include(), "cython"],
            extra_compile_args=["-O3", "-fno-strict-aliasing", "-pthread"],
            extra_link_args=["-pthread"],
        ))
    return cythonize(exts, language_level=3, compiler_directives={"boundscheck": False, "wraparound": False})


setup(ext_modules=_extensions())
