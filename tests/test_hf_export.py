"""`jaxrl convert --to-hf` of a character-model run: the export loads and generates with transformers
alone (AutoTokenizer, AutoModelForCausalLM, generate with the written generation_config.json) and its
greedy completion is jaxrl's."""

import json

import numpy as np
import pytest
from conftest import DEFAULT_CONFIG, TINY

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrl import cli  # noqa: E402
from jaxrl.data.tokenizer import CharTokenizer  # noqa: E402
from jaxrl.models import hf  # noqa: E402
from jaxrl.rollout.sampler import SamplingParams, sample  # noqa: E402

pytestmark = pytest.mark.usefixtures("persistent_compile_cache")


@pytest.mark.slow
def test_exported_run_generates_with_transformers_alone(tmp_path, capsys, in_process_cache):
    run, out = tmp_path / "run", tmp_path / "hf"
    sets = sum((["--set", t] for t in [*TINY, "train.steps=1", "train.progress=false"]), [])
    assert cli.main(["train", str(DEFAULT_CONFIG), *sets, "--workdir", str(run)]) == 0
    assert cli.main(["convert", "--from", str(run), "--to-hf", str(out)]) == 0, capsys.readouterr().err
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }

    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    char, T = CharTokenizer(), 8
    for prompt in ("12+34=", "7*8="):
        ids = tok(prompt, return_tensors="pt")
        assert ids["input_ids"][0].tolist() == [char.bos_id, *char.encode(prompt)]
        with torch.no_grad():
            theirs = model.generate(**ids, do_sample=False, max_new_tokens=T)[0, ids["input_ids"].shape[1] :]

        cfg, params = hf.load(out)
        prompt_1xP = jnp.asarray([[char.bos_id, *char.encode(prompt)]], jnp.int32)
        ours = sample(
            params, cfg, prompt_1xP, jnp.ones(prompt_1xP.shape, bool), jax.random.key(0), group_size=1,
            sampling=SamplingParams(max_new_tokens=T, eos_id=char.eos_id, pad_id=char.pad_id, greedy=True),
        )  # fmt: skip
        ours_T = np.asarray(ours.tokens_BxT)[0]
        n = len(theirs)  # transformers stops at EOS (kept); ours pads after it
        assert theirs.tolist() == ours_T[:n].tolist() and (n == T or theirs[-1] == char.eos_id), (theirs, ours_T)
        assert tok.decode(theirs, skip_special_tokens=True) == char.decode(ours_T.tolist())
