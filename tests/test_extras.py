"""pyproject's accelerator extras: `cuda12` and `tpu` bring JAX's own, and the extras CI and `make test`
install (`test`, `lint`, `hf`) never pull an accelerator wheel (docs/accelerators.md)."""

import pytest
from conftest import REPO

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; 3.10 skips

EXTRAS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _names(extra: str) -> list[str]:
    return [req.split(">")[0].split("=")[0].split("<")[0].strip() for req in EXTRAS[extra]]


def test_accelerator_extras_are_jaxs_own():
    assert _names("cuda12") == ["jax[cuda12]"]
    assert _names("tpu") == ["jax[tpu]"]


def test_cpu_extras_pull_no_accelerator_wheel():
    for extra in ("test", "lint", "hf"):
        for name in _names(extra):
            assert not name.startswith("jax"), (extra, name)
            assert not any(w in name for w in ("cuda", "tpu", "nvidia")), (extra, name)
