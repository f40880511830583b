"""How an engine chunk ends (`decode_chunk`'s stop_at, the host's early stop once a group can be
admitted) and the once-per-collect weight split; outputs stay the greedy sampler's."""

import jax
import numpy as np
import pytest

from jaxrl.rollout.engine import slots as engine_mod
from jaxrl.rollout.engine import state as es
from jaxrl.rollout.engine.groups import batch_of_groups
from tests.test_engine import (
    CFG,
    NEVER,
    PAD,
    G,
    P,
    T,
    _by_tag,
    _check_same_rollout,
    _engine,
    _eos,
    _items,
    _params,
    _plain,
    _prompts,
)


@pytest.mark.slow
def test_chunk_stops_once_stop_at_slots_are_done():
    """Six slots: prompt 0 in slots 0-1 decodes 2 steps alone, then prompt 1 joins in slots 2-3;
    slots 4-5 stay free (done). A 100-step chunk with stop_at=4 ends when prompt 0's samples hit
    T=6 tokens: 6 - 2 = 4 steps, leaving prompt 1's at 4 tokens (done count 2 free + 2 = 4). The
    last chunk (split params, no stop_at) runs to the end, and all four samples equal the greedy
    sampler's."""
    prompt, mask = _prompts()
    spec = es.EngineSpec(
        CFG, slots=6, prompt_len=P, max_new_tokens=T, group_size=G, eos_id=NEVER, pad_id=PAD, greedy=True
    )
    params = _params()
    state = es.init_state(spec, jax.random.PRNGKey(0))
    state = es.admit(params, spec, state, prompt[[0]], mask[[0]], np.asarray([0, 1], np.int32))
    state = es.decode_chunk(params, spec, state, 2, 0, 1.0, 4)  # 4 done (free) already: stop_at is met
    np.testing.assert_array_equal(np.asarray(state.col_S), [0, 0, 0, 0, 0, 0])
    state = es.decode_chunk(params, spec, state, 2, 0, 1.0)
    state = es.admit(params, spec, state, prompt[[1]], mask[[1]], np.asarray([2, 3], np.int32))
    state = es.decode_chunk(params, spec, state, 100, 0, 1.0, 4)
    np.testing.assert_array_equal(np.asarray(state.col_S), [6, 6, 4, 4, 0, 0])
    state = es.decode_chunk(es.split_params(params, CFG), spec, state, 100, 0, 1.0)
    np.testing.assert_array_equal(np.asarray(state.col_S), [6, 6, 6, 6, 0, 0])
    out = jax.device_get(es.read_slots(spec, state, np.arange(4, dtype=np.int32)))
    np.testing.assert_array_equal(out.tokens_RxT, np.asarray(_plain(CFG, NEVER).tokens_BxT)[:4])


def test_engine_admits_as_soon_as_a_group_of_slots_is_free(monkeypatch):
    """Two groups of slots, chunk 100 > T: without the early stop every chunk would run until all
    slots are done. With it, a chunk ends when the group that emits EOS early frees its G slots
    while the other still decodes, and the next prompt is admitted then. Greedy outputs unchanged."""
    seen = []
    real = engine_mod.decode_chunk

    def spy(*args):
        state = real(*args)
        seen.append(int(np.asarray(state.done_S).sum()))
        return state

    monkeypatch.setattr(engine_mod, "decode_chunk", spy)
    eos = _eos(CFG)
    engine = _engine(CFG, eos, slots=2 * G, chunk=100)
    groups = engine.collect(_params(), 0, _items(), n_groups=len(_items()))
    _check_same_rollout(batch_of_groups(_by_tag(groups)).fields(), _plain(CFG, eos), CFG)
    assert any(0 < n < 2 * G for n in seen), seen  # a chunk ended with slots still decoding
    assert seen[-1] == 2 * G


def test_host_readout_equals_device_readout_and_outlives_the_next_chunk():
    """The host's one-round-trip readout (`host_slots` then `read_host_slots`, what `Engine._retire`
    uses) gives exactly `read_slots`'s arrays for any slot order, and stays put when the next chunk
    donates (reuses) the device buffers it was copied from."""
    prompt, mask = _prompts()
    spec = es.EngineSpec(CFG, slots=6, prompt_len=P, max_new_tokens=T, group_size=G, eos_id=_eos(CFG), pad_id=PAD)
    params = _params()
    state = es.init_state(spec, jax.random.PRNGKey(3))
    state = es.admit(params, spec, state, prompt[:2], mask[:2], np.asarray([0, 1, 4, 5], np.int32))
    state = es.decode_chunk(params, spec, state, 3, 7, 1.0)  # sampled: logp and versions differ per slot
    slot_R = np.asarray([5, 2, 0, 4, 1, 3], np.int32)
    want = jax.device_get(es.read_slots(spec, state, slot_R))
    host = es.host_slots(state)
    assert host.cache is None and host.rng is None  # the cache never comes back to the host
    got = es.read_host_slots(spec, host, slot_R)
    state = es.decode_chunk(params, spec, state, 100, 8, 1.0)  # donates `state`'s buffers
    for name, w, g in zip(want._fields, want, es.read_host_slots(spec, host, slot_R)):
        assert (w is None) == (g is None), name
        if w is not None:
            np.testing.assert_array_equal(g, w, err_msg=name)
            assert g.dtype == w.dtype, name
    np.testing.assert_array_equal(got.version_RxT[:, :3], [[7] * 3, [-1] * 3, [7] * 3, [7] * 3, [7] * 3, [-1] * 3])
    assert int(np.asarray(state.version_SxT).max()) == 8  # the second chunk did write the device buffers
