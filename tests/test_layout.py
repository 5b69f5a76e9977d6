"""The package layout: `ops/` (top level, next to `csrc/`) is the package `flexsparse.ops`
both in the checkout (through the symlink flexsparse/ops -> ../ops) and when installed."""
import os
import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run_fresh(code: str, cwd=None) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter that sees the checkout only (the editable install's
    finder is removed, so `flexsparse` can only come from the checkout on sys.path)."""
    prelude = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path\n"
        "                    if not type(f).__module__.startswith('__editable__')\n"
        "                    and not getattr(f, '__module__', '').startswith('__editable__')]\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n")
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=cwd or ROOT,
                          capture_output=True, text=True, timeout=300)


def test_ops_is_a_symlink_into_the_package():
    link = ROOT / "flexsparse" / "ops"
    assert link.is_symlink()
    assert os.readlink(link) == "../ops"
    assert (link / "__init__.py").resolve() == (ROOT / "ops" / "__init__.py").resolve()


def test_checkout_imports_flexsparse_ops_without_installation(tmp_path):
    r = _run_fresh(
        "import flexsparse.ops, torch\n"
        "print(flexsparse.__file__)\n"
        "print(flexsparse.ops.__file__)\n"
        "print(hasattr(torch.ops.flexsparse, 'attention'))\n", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    pkg, ops, has_op = r.stdout.split()
    assert pathlib.Path(pkg) == ROOT / "flexsparse" / "__init__.py"
    assert pathlib.Path(ops) == ROOT / "flexsparse" / "ops" / "__init__.py"
    assert has_op == "True"


def test_top_level_ops_import_is_refused():
    r = _run_fresh("import ops\n")
    assert r.returncode != 0
    assert "import it as that" in r.stderr


def test_wheel_holds_ops_as_flexsparse_ops(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "FLEXSPARSE_BUILD_CUDA": "0"})
    assert r.returncode == 0, r.stderr[-2000:]
    wheels = list(tmp_path.glob("flexsparse-*.whl"))
    assert len(wheels) == 1
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    want = {f"flexsparse/ops/{p.name}" for p in (ROOT / "ops").glob("*.py")}
    assert want and want <= names, sorted(want - names)
    # the files themselves, never a link or a top-level `ops` package
    assert not any(n.startswith("ops/") for n in names)
    assert "flexsparse/integrations/transformers.py" in names
