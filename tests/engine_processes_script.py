"""Run by test_engine_multiprocess.py in one process (8 fake devices) or in each of two (4 each):
EngineSource under mesh.preset=data for each variant in argv, its batches and metrics written by
process 0 as JSON. argv: OUT NUM_PROCESSES PROCESS_ID PORT VARIANT..."""

import json
import sys

out_path, n_processes, process_id, port, *variants = sys.argv[1:]
n_processes, process_id = int(n_processes), int(process_id)

import jax  # noqa: E402

from jaxrl.sharding import init_distributed  # noqa: E402

if n_processes > 1:
    init_distributed(f"localhost:{port}", n_processes, process_id, timeout_s=60)

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402
from conftest import DEFAULT_CONFIG, TINY  # noqa: E402

from jaxrl.config import load_config  # noqa: E402
from jaxrl.data.stream import StreamState  # noqa: E402
from jaxrl.data.tasks import load_task  # noqa: E402
from jaxrl.data.tokenizer import CharTokenizer  # noqa: E402
from jaxrl.models.transformer import init_params, param_logical_axes  # noqa: E402
from jaxrl.sharding import gather_objects, make_mesh, parallel_for, param_shardings, put_global  # noqa: E402
from jaxrl.sources.groups import EngineSource  # noqa: E402

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
STEPS = 3

tok = CharTokenizer()
report = {}
for name in variants:
    cfg = load_config(DEFAULT_CONFIG, [*TINY, *COMMON, *VARIANTS[name]])
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tok.vocab_size)
    task = load_task(cfg.data)
    mesh, preset = make_mesh(cfg.mesh)
    host_params = init_params(model_cfg, jax.random.key(0))
    param_sh = param_shardings(mesh, preset, param_logical_axes(model_cfg), host_params)
    params = jax.tree.map(lambda x, s: put_global(s, np.asarray(x)), host_params, param_sh)

    def source(host, cfg=cfg, model_cfg=model_cfg, task=task, mesh=mesh, preset=preset, param_sh=param_sh):
        return EngineSource(cfg, model_cfg, tok, task, host, parallel_for(mesh, preset), param_sh=param_sh)

    src, stream, steps = source({}), StreamState(), []
    for step in range(1, STEPS + 1):
        if step == STEPS:  # a checkpoint's round trip: the resumed source draws what the running one does
            resumed = source(src.checkpoint_state())
            again = resumed.produce(params, stream, None, step).host_batch
        produced = src.produce(params, stream, None, step)
        stream, batch = produced.stream, produced.host_batch
        if step == STEPS:
            for field, x in batch.fields().items():
                np.testing.assert_array_equal(again.fields()[field], x, err_msg=f"{name} resumed: {field}")
        everyone = gather_objects((batch.prompt_tokens_BxP, batch.tokens_BxT, batch.group_id_B))
        rows = [
            (p[p != tok.pad_id].tolist(), t.tolist(), int(g))
            for prompts, tokens, groups in everyone
            for p, t, g in zip(prompts, tokens, groups)
        ]
        steps.append({"rows": rows, "metrics": produced.metrics})
    report[name] = steps
if jax.process_index() == 0:
    with open(out_path, "w") as f:
        json.dump(report, f)
print("engine processes OK", flush=True)
