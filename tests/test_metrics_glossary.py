"""docs/metrics.md gives every key a run's metrics.jsonl can hold one table row (and no other):
a new metric without a glossary line fails here. No training: the keys come from the code itself.

- slash keys ("reward/mean", "engine/dyn_dropped", ...): every such string literal in jaxrl/, as
  `grep -rhoE '"[a-z_]+/[a-z_0-9@]+"' jaxrl` finds them, less the ones that never reach metrics.jsonl;
- keys built by f-string (engine/<counter>, engine/staleness_<k>): from `engine_metrics` itself;
- the update step's own keys (loss, grad_norm, entropy, kl, the mismatch split, rows_dropped): the
  names steps.py gives its stat sums and metrics;
- the loss's per-token stats (ratio with _min / _max, clipped_low, is_weight, ...): every preset's
  token loss (and the options every preset takes) traced with jax.eval_shape;
- the row's own keys (clip_frac, grad_norm_spike, step_seconds, wall_time): from `report.emit`;
- the loop's (step, microbatches): named here, checked against loop.py's source.
"""

import re
import types

import jax
import numpy as np
from conftest import REPO

from jaxrl.config import LossConfig
from jaxrl.losses import PRESETS, make_loss
from jaxrl.losses.aggregation import reduce_stats
from jaxrl.runlog import report
from jaxrl.sources.groups import engine_metrics

SLASH_KEY = re.compile(r'"([a-z_]+/[a-z_0-9@]+)"')
# Slash strings of jaxrl/ that are not metrics.jsonl keys: `jaxrl eval`'s own report and the progress bar.
NOT_ROW_FILES = ("jaxrl/eval/",)  # jaxrl eval: greedy/accuracy, sampled/format, ... (its JSON, not a run's)
NOT_ROW_KEYS = {"tok/s"}  # report.emit's progress-bar postfix
# Metric names built by f-string ("engine/{k}", "engine/staleness_{k}..."): only group_sources.py does,
# and engine_metrics below yields them all. jaxrl/data/'s f"train/{i}" are record ids, not metrics.
F_STRING_KEY = re.compile(r'f"[a-z_]+/[a-z_0-9]*\{')


def slash_keys() -> set[str]:
    keys = set()
    for path in sorted((REPO / "jaxrl").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if not rel.startswith(NOT_ROW_FILES):
            keys |= set(SLASH_KEY.findall(path.read_text()))
    return keys - NOT_ROW_KEYS


def f_string_keys() -> set[str]:
    builders = {
        rel
        for p in (REPO / "jaxrl").rglob("*.py")
        if not (rel := p.relative_to(REPO).as_posix()).startswith(NOT_ROW_FILES + ("jaxrl/data/",))
        and F_STRING_KEY.search(p.read_text())
    }
    assert builders == {"jaxrl/sources/groups.py"}, f"metric names built by f-string in {builders}: add them here"

    class EveryCounter(dict):  # engine_metrics reports each counter it finds: offer it all of them
        def __contains__(self, key):
            return True

        def __missing__(self, key):
            return 0

    engine = types.SimpleNamespace(counts=EveryCounter(), groups_in_flight=0)
    group = types.SimpleNamespace(version_GxT=np.array([[0, 1, -1], [1, 1, 1]]))
    return set(engine_metrics(engine, {}, [group], version=2))


def update_step_keys() -> set[str]:
    """The update step's own metrics (steps.py): what it names in its stat sums and metrics dicts.
    (Tracing make_update_step would name them exactly, but costs seconds on a busy 2-core machine.)"""
    source = (REPO / "jaxrl" / "train" / "steps.py").read_text()
    keys = set(re.findall(r'(?:sums|metrics)\["([a-z_]+)"\]', source)) | set(re.findall(r'"([a-z_]+)": ', source))
    return keys - {"penalty"}  # the MoE router losses' sum, added to the loss, not a metric


def loss_stat_keys() -> set[str]:
    """Every preset's per-token stats as the metrics name them (masked means; _min / _max for
    aggregation.EXTREMA), with the options every preset takes (KL, entropy, TIS, MIS, top-entropy):
    the token loss traced with jax.eval_shape on a tiny prepared batch (numpy: nothing compiles)."""
    T = 3
    mask = np.ones((4, T), np.float32)
    batch = {
        "completion_mask_BxT": mask,
        "weights_BxT": mask,
        "advantages_B": np.array([1.0, -1.0, 1.0, -1.0], np.float32),
        "group_id_B": np.array([0, 0, 1, 1], np.int32),
        "truncated_B": np.zeros((4,), np.float32),
        **{k: -mask for k in ("old_logp_BxT", "rollout_logp_BxT", "ref_logp_BxT", "teacher_logp_BxT")},
        **{k: mask for k in ("entropy_BxT", "old_entropy_BxT", "m2po_keep_BxT", "entropy_keep_BxT")},
        "advantages_BxT": mask,  # the distill preset's prepare writes per-token advantages
    }
    configs = [LossConfig(preset=name) for name in PRESETS] + [
        LossConfig(kl_beta=0.1, options="tis_cap=2, top_entropy_frac=0.5, entropy_coef=0.01"),
        LossConfig(options="mis_high=2"),
    ]
    token_losses = [make_loss(cfg).token_loss for cfg in configs]

    def all_stats(logp, b):  # one trace for all of them
        return [reduce_stats(token_loss(logp, b)[1], b["completion_mask_BxT"]) for token_loss in token_losses]

    return {k for stats in jax.eval_shape(all_stats, -mask, batch) for k in stats}


def row_keys() -> set[str]:
    """What report.emit adds to every training row."""
    log = types.SimpleNamespace(rows=[], write=lambda row: log.rows.append(row))
    bar = types.SimpleNamespace(n=0, update=lambda n: None, set_postfix=lambda post: None)
    row = {"step": 1, "reward/mean": 0.0, "rollout/tokens_per_s": 0.0}
    report.emit(log, bar, row, {"loss": 0.0, "grad_norm": 1.0}, 0.0)
    return set(log.rows[0]) - set(row) - {"loss", "grad_norm"}


def loop_keys() -> set[str]:
    source = (REPO / "jaxrl" / "train" / "loop.py").read_text()
    assert '{"step": step' in source and "microbatches=auto" in source  # the row's step; auto microbatches
    return {"step", "microbatches"}


def glossary() -> list[str]:
    """The keys docs/metrics.md gives a line: the first cell of each table row."""
    return re.findall(r"^\| `([^`]+)` \|", (REPO / "docs" / "metrics.md").read_text(), re.MULTILINE)


def test_every_metric_key_has_a_glossary_line():
    keys = slash_keys() | f_string_keys() | update_step_keys() | loss_stat_keys() | row_keys() | loop_keys()
    # the collectors found what a default run writes and what only options write
    assert {"reward/mean", "engine/staleness_2+", "engine/drafted", "ratio_min", "is_weight_max"} <= keys
    assert {"mismatch_abs_logp_fresh", "kl", "clip_frac", "step_seconds", "clipped_dual", "gate"} <= keys
    lines = glossary()
    assert not (missing := sorted(keys - set(lines))), f"docs/metrics.md has no line for {missing}"
    assert not (stale := sorted(set(lines) - keys)), f"docs/metrics.md explains no such metric: {stale}"
    assert len(lines) == len(set(lines)), "a key with two lines in docs/metrics.md"
