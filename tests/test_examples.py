"""docs/examples/*.py run as users run them (a fresh Python process each, on this machine's
device: the reference backend on CPU). Each script asserts its results against a float64
or eager reference itself; here: exit status 0 and its final OK line."""
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "docs" / "examples"
SCRIPTS = {
    "compiled_training_step": "loss and gradients match the dense reference",
    "from_flex_attention": "three conversions agree with flex_attention",
    "hf_model": "padding, generate and packed training match eager",
    "trainable_bias": "bias gradient matches float64 and the bias trains",
    "nsa_topk": "selected attention matches float64 on the dense masks",
}


def test_every_example_is_tested():
    assert sorted(p.stem for p in EXAMPLES.glob("*.py")) == sorted(SCRIPTS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_example_runs(name):
    if name == "hf_model":
        pytest.importorskip("transformers")
    r = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py")], capture_output=True,
                       text=True, timeout=600, cwd=EXAMPLES.parent.parent)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith(f"OK {name} on ") and last.endswith(SCRIPTS[name]), r.stdout[-2000:]
