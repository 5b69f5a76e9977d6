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


# ---------------------------------------------------------------- layers
# Every module of the package, lowest layer first. A module may import only modules
# listed before it (at module level or inside functions): no import circles, nothing
# imports upward. docs/design.md draws the same picture.
LAYERS = [
    # the op and its backends (plain tensors; no mask classes)
    "flexsparse.ops.schema",            # op schemas, MaskTensors, fakes, autograd
    "flexsparse.ops.kernel_options",    # per-call kernel options, carried in the backend string
    "flexsparse.ops.mask_checks",       # the raw op's input checks (eager and fake kernels)
    "flexsparse.ops.visibility",        # what mask tensors make visible (shared semantics)
    "flexsparse.ops.reference",         # the reference backend: attention by those semantics
    "flexsparse.ops.triton_compat",
    "flexsparse.ops.triton_launch",
    "flexsparse.ops.triton_block_mask",    # the descriptor as kernel arguments, and its reads
    "flexsparse.ops.triton_block_common",  # shared by the passes: device helpers, tiles, args
    "flexsparse.ops.triton_block_fwd",     # forward kernel + its plan
    "flexsparse.ops.triton_block_bwd",     # backward kernels + their plan
    "flexsparse.ops.triton_block",         # block backend entry: forward, backward, _Call
    "flexsparse.ops.triton_indices",
    "flexsparse.ops.triton_backend",
    "flexsparse.ops.cuda_backend",
    "flexsparse.ops.backends",          # registry, op implementations, "auto"
    "flexsparse.ops",
    # mask-building kernels (Triton; descriptors built on the GPU)
    "flexsparse.triton_ranges",         # column ranges -> block lists (used by blocklists)
    "flexsparse.triton_intervals",      # interval specs -> column ranges (used by intervals)
    "flexsparse.triton_topk",           # top-k positions per score row (used by topk)
    # mask helpers without a mask type
    "flexsparse.intervals",
    "flexsparse.topk",
    # the descriptor: one type and its builders
    "flexsparse.descriptor",
    "flexsparse.blocklists",
    "flexsparse.build_op",              # per-step mask builds in one C++ op call (csrc/)
    "flexsparse.index_blocks",
    # mask constructors
    "flexsparse.masks",
    # converters: FlexAttention in and out
    "flexsparse.flex",
    # the public API and what sits on it
    "flexsparse.api",
    "flexsparse",
    "flexsparse.__main__",
    "flexsparse.integrations",
    "flexsparse.integrations.transformers",
]
# Built outside Python (csrc/), imported by the package as a whole: no layer of its own.
NOT_PYTHON = {"flexsparse._C"}


def _module_files():
    """module name -> file, for every .py file of the package (through the ops symlink)."""
    out = {}
    paths = [pathlib.Path(d, f) for d, _, fs in os.walk(ROOT / "flexsparse", followlinks=True)
             for f in fs if f.endswith(".py")]
    for path in sorted(paths):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path):
    """Absolute names of the flexsparse modules that `path` imports anywhere in it."""
    import ast
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    known = set(LAYERS) | NOT_PYTHON
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` names a module; `from mod import name` a name in it
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            if t == "flexsparse" or t.startswith("flexsparse."):
                while t not in known and "." in t:
                    t = t.rpartition(".")[0]    # flexsparse.ops.schema.X -> its module
                found.add(t)
    return found


def test_every_module_has_a_layer():
    assert set(_module_files()) == set(LAYERS)
    assert len(LAYERS) == len(set(LAYERS))


def test_no_module_imports_a_higher_layer():
    files = _module_files()
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for name in LAYERS:
        for target in sorted(_imports(name, files[name]) - NOT_PYTHON):
            if target == name:
                continue
            if rank[target] > rank[name]:
                upward.append(f"{name} imports {target}")
    assert not upward, upward


def test_modules_import_in_layer_order_in_a_fresh_interpreter():
    """Import every module in LAYERS order, each seeing only the modules before it: the
    packages' __init__ files run only at their own place in the order (until then the
    packages are empty shells), and after each import no later module may be loaded."""
    files = {n: str(p) for n, p in _module_files().items()}
    code = f"""
import importlib.util, sys, types
LAYERS, FILES, ROOT = {LAYERS!r}, {files!r}, {str(ROOT)!r}
for pkg, path in (("flexsparse", ROOT + "/flexsparse"), ("flexsparse.ops", ROOT + "/flexsparse/ops"),
                  ("flexsparse.integrations", ROOT + "/flexsparse/integrations")):
    shell = types.ModuleType(pkg)
    shell.__path__ = [path]
    shell.__package__ = pkg
    sys.modules[pkg] = shell
for i, name in enumerate(LAYERS):
    mod = sys.modules.get(name)
    if name in ("flexsparse", "flexsparse.ops", "flexsparse.integrations"):
        spec = importlib.util.spec_from_file_location(name, FILES[name],
                                                      submodule_search_locations=mod.__path__)
        mod.__spec__, mod.__file__ = spec, FILES[name]
        spec.loader.exec_module(mod)
    else:
        importlib.import_module(name)
    loaded = {{m for m in sys.modules if m == "flexsparse" or m.startswith("flexsparse.")}}
    later = sorted(loaded & set(LAYERS[i + 1:]) - {{"flexsparse", "flexsparse.ops",
                                                     "flexsparse.integrations"}})
    assert not later, (name, later)
print("imported", len(LAYERS))
"""
    r = _run_fresh(code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["imported", str(len(LAYERS))]
