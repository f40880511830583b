"""`jaxrl plan` and non-dividing parameter dimensions.

In process: the collective counter, `spec_for` on an abstract mesh (the error names the parameter,
the dimension and the axis; `mesh.allow_replicated` opts in), the config field's validation. In one
child with 8 fake CPU devices (`python tests/test_plan.py worker`): `jaxrl plan` through the CLI's
`main` for the tiny default config on one device (`mesh.preset=single`) and on 8 under `data` and
`fsdp`, the one-line error of a non-dividing dimension for `plan` and `train` (before any dataset or
warm start), and the opt-in's layout report.
"""

import io
import json
import os
import pathlib
import sys
from contextlib import redirect_stdout

import pytest
from conftest import DEFAULT_CONFIG, REPO, TINY
from harness import worker_result

TINY_ARGS = [a for t in TINY for a in ("--set", t)]
KV = ["--set", "mesh.preset=fsdp_tensor", "--set", "mesh.tensor=2"]  # TINY has 1 kv head: it cannot split 2 ways


def _main(*args: str) -> dict:
    """cli.main(ARGS) in this process: exit code, JSON lines of stdout, everything written to fd 2."""
    import tempfile

    from jaxrl import cli

    out = io.StringIO()
    with tempfile.TemporaryFile("w+") as err:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            with redirect_stdout(out):
                code = cli.main(list(args))
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        stderr = err.read()
    records = [json.loads(x) for x in out.getvalue().splitlines() if x.startswith("{")]
    return {"code": code, "records": records, "stderr": stderr}


def _worker() -> None:
    import tempfile

    import jax

    assert jax.device_count() == 8
    # 8 prompts: the update forwards each group's prompt once (train.share_prefix), so fewer prompts than
    # devices would leave that forward unsplit.
    plan = ["plan", str(DEFAULT_CONFIG), *TINY_ARGS, "--set", "rollout.prompts_per_step=8", "--devices", "8"]
    plan += ["--programs", "update,rollout"]
    results = {preset: _main(*plan, "--set", f"mesh.preset={preset}") for preset in ("single", "data", "fsdp")}
    results["error"] = _main(*plan, *KV)
    results["allowed"] = _main(*plan, *KV, "--set", "mesh.allow_replicated=blocks/attn/[kv]*,embedding")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["JAXRL_CACHE_DIR"] = str(pathlib.Path(tmp) / "cache")
        os.environ["JAXRL_DATA_DIR"] = str(pathlib.Path(tmp) / "data")
        results["train"] = _main(
            "train", str(DEFAULT_CONFIG), *TINY_ARGS, *KV, "--workdir", str(pathlib.Path(tmp) / "r")
        )
        results["train"]["made"] = sorted(p.name for p in pathlib.Path(tmp).iterdir())
    print("RESULT " + json.dumps(results))


@pytest.fixture(scope="module")
def results(cache_env):
    return worker_result(__file__, cache_env, timeout=600)[0]


def _by_program(result: dict) -> dict:
    assert result["code"] == 0, result["stderr"][-2000:]
    return {r["program"]: r for r in result["records"]}


@pytest.mark.slow
def test_plan_records_have_the_keys_and_sane_values(results):
    for preset, devices in (("single", 1), ("data", 8), ("fsdp", 8)):
        got = _by_program(results[preset])
        assert sorted(got) == ["rollout", "update"]
        for r in got.values():
            assert r["devices"] == devices and r["mesh"]["preset"] == preset
            assert r["flops_per_device"] > 0 and r["bytes_accessed_per_device"] > 0
            assert set(r["memory_mib"]) == {"argument", "temp", "output", "alias"}
            assert r["memory_mib"]["argument"] > 0 and r["memory_mib"]["temp"] > 0
            assert set(r["collectives"]) == {
                "all-gather",
                "all-reduce",
                "all-to-all",
                "reduce-scatter",
                "collective-permute",
            }
        assert got["update"]["microbatches"] == 1 and got["update"]["inputs"]["tokens_BxT"]
    one = _by_program(results["single"])
    assert not any(one["update"]["collectives"].values())  # one device: nothing to communicate
    data, fsdp = _by_program(results["data"]), _by_program(results["fsdp"])
    assert data["update"]["collectives"]["all-reduce"] > 0  # the gradients' sum over the data axis
    assert fsdp["update"]["collectives"]["all-gather"] > 0  # the weights gathered for each use
    # Layout: data replicates every parameter (and says why), fsdp splits every one (all have an embed axis).
    assert data["update"]["layout"]["split"] == [] and data["update"]["layout"]["replicated"]
    assert all("logical axes" in r["why"] for r in data["update"]["layout"]["replicated"])
    assert fsdp["update"]["layout"]["replicated"] == [] and fsdp["update"]["layout"]["split"]
    assert fsdp["update"]["memory_mib"]["argument"] < data["update"]["memory_mib"]["argument"] / 4
    assert data["update"]["inputs"]["tokens_BxT"] == "P('data',)"
    assert "jaxrl plan: update on 8 devices (mesh.preset=data: data=8)" in results["data"]["stderr"]


@pytest.mark.slow
def test_data_parallel_update_does_an_eighth_of_the_work_per_device(results):
    """The claim of data parallelism, on the compiled programs: per-device FLOPs on 8 devices within
    15% of 1/8 of one device's (the update and the rollout, under data and fsdp)."""
    one = _by_program(results["single"])
    for preset in ("data", "fsdp"):
        got = _by_program(results[preset])
        for program in ("update", "rollout"):
            ratio = got[program]["flops_per_device"] * 8 / one[program]["flops_per_device"]
            assert ratio <= 1.15, (preset, program, ratio)


@pytest.mark.slow
def test_a_dimension_that_does_not_divide_is_one_line_naming_it(results):
    want = (
        "jaxrl: error: parameter blocks/attn/k: dimension 2 ('kv_heads', size 1) does not divide over mesh axis "
        "'tensor' of 2 devices: choose a device count or mesh size that divides it, or replicate that dimension "
        "with mesh.allow_replicated (e.g. --set mesh.allow_replicated=blocks/attn/k)"
    )
    for case in ("error", "train"):
        r = results[case]
        assert r["code"] == 2 and r["stderr"].strip().splitlines() == [want], r
    # `train` stops before building the dataset or the warm start: neither cache was created.
    assert "cache" not in results["train"]["made"] and "data" not in results["train"]["made"], results["train"]


@pytest.mark.slow
def test_allow_replicated_opts_in_and_the_layout_says_why(results):
    got = _by_program(results["allowed"])
    layout = got["update"]["layout"]
    # k and v keep their embed axis split over fsdp; the kv-head axis is the one replicated, and said so.
    # (The character vocabulary of 23 tokens does not split over tensor=2 either: the embedding opts in too.)
    assert layout["replicated"] == []
    kept = {r["name"]: r for r in layout["split"] if "why" in r}
    assert sorted(kept) == ["blocks/attn/k", "blocks/attn/v", "embedding"]
    assert kept["blocks/attn/k"]["spec"] == "P(None, 'fsdp', None, None)"
    assert "dimension 0 ('vocab', size 23)" in kept["embedding"]["why"]
    assert (
        "dimension 2 ('kv_heads', size 1) does not divide over mesh axis 'tensor' of 2" in kept["blocks/attn/k"]["why"]
    )
    assert "mesh.allow_replicated" in kept["blocks/attn/k"]["why"]
    assert {r["name"] for r in layout["split"]} >= {"blocks/attn/q", "embedding"}


def test_spec_for_names_the_parameter_or_replicates_when_allowed():
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as P

    from jaxrl.config import ConfigError
    from jaxrl.sharding import PRESETS, layout_of, spec_for

    mesh, preset = AbstractMesh((3, 2), ("fsdp", "tensor")), PRESETS["fsdp_tensor"]
    assert spec_for(mesh, preset, ("embed", "kv_heads"), (6, 4), "a/b") == P("fsdp", "tensor")
    with pytest.raises(ConfigError, match=r"^parameter a/b: dimension 0 \('embed', size 3584\)") as e:
        spec_for(mesh, preset, ("embed", "kv_heads"), (3584, 4), "a/b")
    assert "mesh axis 'fsdp' of 3 devices" in str(e.value)
    allowed = preset._replace(allow_replicated=("a/*",))
    assert spec_for(mesh, allowed, ("embed", "kv_heads"), (3584, 4), "a/b") == P(None, "tensor")
    with pytest.raises(ConfigError, match="parameter c/b"):  # the pattern matches a/*, not c/b
        spec_for(mesh, allowed, ("embed",), (3584,), "c/b")
    assert spec_for(mesh, preset, ("embed", "kv_heads")) == P("fsdp", "tensor")  # no shape: nothing to check

    import jax

    logical = {"w": P("embed", "mlp"), "n": P(None)}
    shapes = {"w": jax.ShapeDtypeStruct((6, 8), "float32"), "n": jax.ShapeDtypeStruct((5,), "float32")}
    layout = layout_of(mesh, preset, logical, shapes)
    assert layout["split"] == [{"name": "w", "shape": [6, 8], "spec": "P('fsdp', 'tensor')"}]
    assert layout["replicated"][0]["name"] == "n" and "none of its logical axes" in layout["replicated"][0]["why"]


def test_allow_replicated_is_validated():
    from jaxrl.config import ConfigError, MeshConfig

    MeshConfig(preset="fsdp", allow_replicated=("blocks/*",)).validate()
    with pytest.raises(ConfigError, match=r"^mesh\.allow_replicated: got \(' x',\), expected parameter path"):
        MeshConfig(allow_replicated=(" x",)).validate()
    with pytest.raises(ConfigError, match=r"balanced \[\.\.\.\]"):  # --set strips a trailing ']'
        MeshConfig(allow_replicated=("blocks/attn/[kv",)).validate()


def test_collectives_are_counted_by_kind_from_the_hlo_text():
    from jaxrl.train.plan import count_collectives, parse_programs

    hlo = (
        "  %all-reduce.1 = f32[] all-reduce(f32[] %x), replica_groups={}\n"
        "  %ag = f32[8] all-gather-start(f32[1] %y)\n  %d = f32[8] all-gather-done(%ag)\n"
        "  %cp = f32[2] collective-permute(f32[2] %z)\n  %n = f32[] add(%a, %b)\n"
    )
    assert count_collectives(hlo) == {
        "all-gather": 1,
        "all-reduce": 1,
        "all-to-all": 0,
        "reduce-scatter": 0,
        "collective-permute": 1,
    }
    assert parse_programs("update, eval") == ("update", "eval")
    from jaxrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"^--programs: got 'updat'"):
        parse_programs("updat")


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    sys.path.insert(0, str(REPO))
    _worker()
