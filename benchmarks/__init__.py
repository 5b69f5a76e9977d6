"""Benchmarks of flexsparse against FlexAttention and SDPA (not part of the installed
package; run from the checkout, e.g. `python -m benchmarks.bench`). See README.md here."""
