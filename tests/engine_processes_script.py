"""Run by test_engine_multiprocess.py in one process (8 fake devices) or in each of two (4 each):
EngineSource, or AgentSource (multi-turn episodes, variants agent*), under mesh.preset=data for each
variant in argv, its batches (read back from the update's global arrays), metrics and stream
positions (and an agent variant's evaluation) written by process 0 as JSON.
argv: OUT NUM_PROCESSES PROCESS_ID PORT VARIANT..."""

import json
import sys

out_path, n_processes, process_id, port, *variants = sys.argv[1:]
n_processes, process_id = int(n_processes), int(process_id)

import jax  # noqa: E402

from jaxrl.multihost import init_distributed  # noqa: E402

if n_processes > 1:
    init_distributed(f"localhost:{port}", n_processes, process_id, timeout_s=60)

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402
from conftest import DEFAULT_CONFIG, REPO, TINY  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from jaxrl.config import load_config  # noqa: E402
from jaxrl.data.stream import StreamState  # noqa: E402
from jaxrl.data.tasks import load_task  # noqa: E402
from jaxrl.data.tokenizer import CharTokenizer  # noqa: E402
from jaxrl.models.transformer import init_params, param_logical_axes  # noqa: E402
from jaxrl.multihost import gather_objects, put_global  # noqa: E402
from jaxrl.policy.base import build_base  # noqa: E402
from jaxrl.sharding import make_mesh, parallel_for, param_shardings  # noqa: E402
from jaxrl.sources.agents import AgentSource, make_agent_evaluator  # noqa: E402
from jaxrl.sources.groups import EngineSource  # noqa: E402
from jaxrl.sources.scoring import assemble_batch  # noqa: E402
from jaxrl.train.evaluate import eval_records  # noqa: E402

COMMON = [
    "mesh.preset=data",
    "rollout.prompts_per_step=4",
    "rollout.group_size=2",
    "rollout.max_new_tokens=6",
    "rollout.engine.enabled=true",
    "rollout.engine.slots=8",
    "rollout.engine.chunk=2",
    "rollout.engine.admit_groups=2",
]
VARIANTS = {  # top_k=1: each prompt's completion is its greedy one, whatever slot or process draws it
    "exact": ["rollout.top_k=1"],
    # twice the slots a step needs: each step leaves groups for the next (carried across versions)
    "fill": [
        "rollout.top_k=1",
        "rollout.engine.slots=16",
        "rollout.engine.admission=fill",
        "rollout.engine.reprefill=true",
    ],
    "dynamic": [
        "rollout.engine.dynamic_sampling=true",
        "rollout.engine.max_extra_groups=4",
        "rollout.engine.prompt_filter=beta",
    ],
    "vigor": ["rollout.engine.allocation=vigor", "rollout.engine.initial_samples=1"],
}
# Multi-turn episodes (sources/agents.py) on the calculator, from its warm start; 8 rows over 8 devices.
AGENT_CONFIG = REPO / "configs" / "agent_calculator.py"
AGENT_COMMON = [
    *(t for t in TINY if not t.startswith("data.")),
    "mesh.preset=data",
    "data.num_train=200",
    "data.num_test=20",
    "rollout.prompts_per_step=4",
    "rollout.group_size=2",
    "rollout.engine.slots=8",
    "train.eval_prompts=7",  # uneven over 2 processes: blocks of 3 and 4
]
AGENT_VARIANTS = {
    "agent": [],  # sampled at the config's temperature 1: episode (j, g)'s key is the same on any process
    "agent_starpo": ["agent.keep_top_variance=0.5"],
}
STEPS = 3


def global_rows(batch, mesh, preset, n_rows: int) -> list:
    """The step's batch as the update gets it (`assemble_batch`: one global array per field), read back
    whole on every process: (prompt, tokens, group id) per row, in global row order."""
    arrays = assemble_batch(batch, None, mesh, preset, n_rows)
    prompts, tokens, groups = (
        np.asarray(multihost_utils.process_allgather(arrays[k], tiled=True))
        for k in ("prompt_tokens_BxP", "tokens_BxT", "group_id_B")
    )
    return [(p[p != tok.pad_id].tolist(), t.tolist(), int(g)) for p, t, g in zip(prompts, tokens, groups)]


def run_steps(source, params, mesh, preset, name: str) -> list:
    """STEPS steps of `source(host)`; at the last, a source rebuilt from the running one's checkpoint
    state draws the same batch (a checkpoint's round trip)."""
    src, stream, steps = source({}), StreamState(), []
    for step in range(1, STEPS + 1):
        if step == STEPS:  # a checkpoint's round trip: the resumed source draws what the running one does
            resumed = source(src.checkpoint_state())
            again = resumed.produce(params, stream, None, step).host_batch
        produced = src.produce(params, stream, None, step)
        batch = produced.host_batch
        if step == STEPS:
            for field, x in batch.fields().items():
                np.testing.assert_array_equal(again.fields()[field], x, err_msg=f"{name} resumed: {field}")
        n_rows = src.cfg.rollout.prompts_per_step * src.cfg.rollout.group_size * jax.process_count()
        row = {"rows": global_rows(batch, mesh, preset, n_rows), "metrics": produced.metrics}
        steps.append({**row, "stream": list(produced.stream), "all_streams": gather_objects(list(produced.stream))})
        stream = produced.stream
    return steps


def engine_steps(name: str) -> list:
    cfg = load_config(DEFAULT_CONFIG, [*TINY, *COMMON, *VARIANTS[name]])
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tok.vocab_size)
    task = load_task(cfg.data)
    mesh, preset = make_mesh(cfg.mesh)
    host_params = init_params(model_cfg, jax.random.key(0))
    param_sh = param_shardings(mesh, preset, param_logical_axes(model_cfg), host_params)
    params = jax.tree.map(lambda x, s: put_global(s, np.asarray(x)), host_params, param_sh)

    def source(host):
        return EngineSource(cfg, model_cfg, tok, task, host, parallel_for(mesh, preset), param_sh=param_sh)

    return run_steps(source, params, mesh, preset, name)


def agent_steps(name: str) -> dict:
    """The steps of AgentSource, and the greedy evaluation of the same params."""
    cfg = load_config(AGENT_CONFIG, [*AGENT_COMMON, *AGENT_VARIANTS[name]])
    mesh, preset = make_mesh(cfg.mesh)
    tokenizer, model_cfg, task, params, _, param_sh = build_base(cfg, False, mesh, preset)
    suite, ep = task.spec.suite, parallel_for(mesh, preset)

    def source(host):
        return AgentSource(cfg, model_cfg, tokenizer, task, suite, host, ep, param_sh=param_sh)

    steps = run_steps(source, params, mesh, preset, name)
    records = eval_records(cfg, task.test)
    evaluate = make_agent_evaluator(cfg, model_cfg, tokenizer, suite, records, ep, param_sh=param_sh)
    return {"steps": steps, "eval": evaluate(params)}


tok = CharTokenizer()
report = {name: agent_steps(name) if name in AGENT_VARIANTS else engine_steps(name) for name in variants}
if jax.process_index() == 0:
    with open(out_path, "w") as f:
        json.dump(report, f)
print("engine processes OK", flush=True)
