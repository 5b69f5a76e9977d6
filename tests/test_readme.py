"""The README's quick example is copied by new users first: it must run as written (here on
CPU, where it takes the reference backend)."""
import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_quick_example_runs():
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    scope = {}
    exec(compile(code, str(README), "exec"), scope)
    out, bias = scope["out"], scope["bias"]
    assert out.shape == scope["q"].shape and not out.isnan().any()
    assert bias.grad is not None and bias.grad.shape == bias.shape
