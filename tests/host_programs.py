"""Host C++ test programs (tests/host/*.cpp): csrc headers compiled without nvcc and run
on the CPU, for the tests that check device code's logic here."""
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def host_program(tmp_path_factory, name: str) -> pathlib.Path:
    """tests/host/<name>.cpp compiled with the host C++ compiler (csrc/ and tests/host on
    the include path), its path; skips without g++."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip(f"no host C++ compiler (g++) to build tests/host/{name}.cpp")
    exe = tmp_path_factory.mktemp(name) / name
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wno-unknown-pragmas",
                    "-I", str(ROOT / "tests" / "host"), "-I", str(ROOT / "csrc"),
                    str(ROOT / "tests" / "host" / f"{name}.cpp"), "-o", str(exe)], check=True)
    return exe
