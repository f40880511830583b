"""A loss of the user's own, from a config file outside the repository: registered, selected by name,
by --set or as "module:attr", trained and evaluated with the CLI, or given to `train()` from Python;
every contract mistake a one-line error naming it. The example config is docs/extending.md's."""

import dataclasses
import json
import re
import textwrap
import types

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEFAULT_CONFIG, REPO, TINY

from jaxrl import cli, losses
from jaxrl.config import ConfigError, LossConfig, load_config

TINY_ARGS = sum((["--set", t] for t in TINY), [])


def _docs_example() -> str:
    text = (REPO / "docs" / "extending.md").read_text()
    blocks = re.findall(r"<!-- docs-test: file my_loss.py -->\n```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1, "docs/extending.md: the bring-your-own-loss example block is missing"
    return blocks[0]


@pytest.fixture(autouse=True)
def _presets_restored():
    """Config files register into the process's PRESETS; each test starts from the built-ins."""
    saved = dict(losses.PRESETS)
    yield
    losses.PRESETS.clear()
    losses.PRESETS.update(saved)


@pytest.fixture()
def user_config(tmp_path):
    path = tmp_path / "user" / "my_loss.py"
    path.parent.mkdir()
    path.write_text(_docs_example())
    return path


def _write(tmp_path, name: str, body: str):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _cli(capsys, *args):
    code = cli.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err.strip()


def _one_line_error(capsys, *args) -> str:
    code, _, err = _cli(capsys, *args)
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("jaxrl: error: "), err
    return err


# ----------------------------------------------------------------------------- registration


def test_registered_preset_is_a_preset_like_the_builtins(user_config):
    cfg = load_config(user_config)
    assert cfg.loss.preset == "gspo_dr" and "gspo_dr" in losses.PRESETS
    loss = losses.make_loss(cfg.loss)
    assert loss.parts[:4] == (
        "reward_sum -> group_mean",
        "sequence_log_ratio",
        "ppo_clip(0.0003, 0.0004)",
        "entropy_bonus(0.001)",
    )
    losses.check_rollout("gspo_dr", 2)
    load_config(user_config)  # the same file loaded again re-registers its own factory
    with pytest.raises(ConfigError, match="register_preset: 'gspo_dr' is already a preset"):
        losses.register_preset("gspo_dr", losses.grpo)
    with pytest.raises(ConfigError, match="register_preset: 'grpo' is already a preset"):
        losses.register_preset("grpo", losses.PRESETS["gspo_dr"].factory)
    losses.register_preset("gspo_dr", losses.grpo, replace=True)
    assert losses.make_loss(cfg.loss).parts[1] == "token_log_ratio"


def test_set_selects_a_user_preset_and_checks_its_options(capsys, tmp_path, user_config):
    """The file registers before --set applies: the override reaches gspo_dr, whose parameters the
    options are checked against."""
    config = _write(
        tmp_path,
        "grpo_too.py",
        f"""
        import dataclasses, importlib.util
        spec = importlib.util.spec_from_file_location("my_loss", {str(user_config)!r})
        my_loss = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(my_loss)

        def get_config():
            cfg = my_loss.get_config()
            return dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, preset="grpo"))
        """,
    )
    cfg = load_config(config, ["loss.preset=gspo_dr"])
    assert losses.make_loss(cfg.loss).parts[1] == "sequence_log_ratio"
    err = _one_line_error(
        capsys, "train", str(config), "--workdir", str(tmp_path / "w"), "--set", "loss.preset=gspo_dr",
        "--set", "loss.options=tis_cp=2",
    )  # fmt: skip
    assert "preset 'gspo_dr' has no parameter 'tis_cp'; allowed: kl_beta" in err and "did you mean 'tis_cap'?" in err


def test_misspelt_preset_is_one_line_naming_it(capsys, tmp_path, user_config):
    err = _one_line_error(
        capsys, "train", str(user_config), "--workdir", str(tmp_path / "w"), "--set", "loss.preset=gspo_rd"
    )
    assert "loss.preset: got 'gspo_rd', expected one of" in err and err.endswith("did you mean 'gspo_dr'?")


def test_variants_lists_the_presets_a_config_registers(capsys, user_config):
    code, out, err = _cli(capsys, "variants", str(user_config))
    assert code == 0, err
    assert "| gspo_dr | GSPO ratio x Dr.GRPO advantages | reward_sum -> group_mean ; sequence_log_ratio" in out
    assert "| grpo |" in out


# ----------------------------------------------------------------------------- the contract


BROKEN = """
    import types
    from jaxrl import losses

    def no_token_loss(kl_beta=0.0, reward_weights=None):
        good = losses.grpo()
        return types.SimpleNamespace(name="broken", advantages=good.advantages, weights=good.weights)

    def one_argument(kl_beta=0.0, reward_weights=None):
        return losses.grpo()._replace(token_loss=lambda logp_BxT: (logp_BxT, {{}}))

    losses.register_preset("no_token_loss", no_token_loss)
    losses.register_preset("one_argument", one_argument)
    {extra}

    def get_config():
        from jaxrl.config import Config, LossConfig
        return Config(loss=LossConfig(preset={preset!r}))
    """


@pytest.mark.parametrize(
    "preset, extra, needle",
    [
        ("no_token_loss", "", "loss.preset='no_token_loss': SimpleNamespace has no 'token_loss', a field of the Loss"),
        ("one_argument", "", "Loss.token_loss cannot be called as token_loss(logp_BxT, batch)"),
        (
            "grpo",
            "losses.register_preset('ready', types.SimpleNamespace(name='x', advantages=len, token_loss=len))",
            "register_preset('ready'): SimpleNamespace has no 'weights', a field of the Loss contract",
        ),
    ],
)
def test_a_loss_breaking_the_contract_is_one_line_naming_the_field(capsys, tmp_path, preset, extra, needle):
    config = _write(tmp_path, "broken.py", BROKEN.format(preset=preset, extra=extra))
    err = _one_line_error(capsys, "train", str(config), "--workdir", str(tmp_path / "w"), *TINY_ARGS)
    assert needle in err


def test_module_attr_preset_imports_a_factory_or_a_loss(tmp_path, monkeypatch):
    _write(
        tmp_path,
        "my_losses.py",
        """
        from jaxrl import losses

        def token_mean_grpo(kl_beta=0.0, reward_weights=None, **extras):
            return losses.compose("token_mean_grpo", reward_combine=losses.reward_sum(reward_weights),
                                  normaliser=losses.group_mean_std(), ratio=losses.token_log_ratio,
                                  objective=losses.ppo_clip(0.2, 0.28), weights=losses.token_mean,
                                  options=losses.option_parts(kl_beta, **extras))

        READY = token_mean_grpo()
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_losses

    built = losses.make_loss(LossConfig(preset="my_losses:token_mean_grpo", options={"tis_cap": 2.0}))
    assert built.parts[-2:] == ("tis(cap=2.0, token)", "token_mean")
    assert losses.make_loss(LossConfig(preset="my_losses:READY")) is my_losses.READY
    losses.check_rollout("my_losses:READY", 2)
    with pytest.raises(ConfigError, match="loss.options: preset 'my_losses:READY' has no parameter 'tis_cap'"):
        losses.make_loss(LossConfig(preset="my_losses:READY", options={"tis_cap": 2.0}))
    with pytest.raises(ConfigError, match="loss.kl_beta: got 0.1, but preset 'my_losses:READY' has no kl_beta"):
        losses.make_loss(LossConfig(preset="my_losses:READY", kl_beta=0.1))
    with pytest.raises(ConfigError, match="'my_losses' has no attribute 'nope'"):
        losses.make_loss(LossConfig(preset="my_losses:nope"))
    with pytest.raises(ConfigError, match="cannot import 'no_such_module'"):
        losses.make_loss(LossConfig(preset="no_such_module:x"))


# ----------------------------------------------------------------------------- options


def test_options_dict_and_string_build_the_same_loss():
    as_dict = LossConfig(preset="dapo", options={"tis_cap": 2.0, "is_level": "sequence", "entropy_coef": 0.01})
    as_text = LossConfig(preset="dapo", options="tis_cap=2.0, is_level=sequence, entropy_coef=0.01")
    a, b = losses.make_loss(as_dict), losses.make_loss(as_text)
    assert a.parts == b.parts and "tis(cap=2.0, sequence)" in a.parts
    mask = jnp.array([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], jnp.float32)
    batch = {
        "completion_mask_BxT": mask,
        "rewards_BxK": jnp.array([[1.0], [0.0], [0.5], [0.0]]),
        "truncated_B": jnp.zeros((4,)),
        "rollout_logp_BxT": jnp.log(jnp.full((4, 3), 0.4)) * mask,
    }
    logp, entropy = jnp.log(jnp.full((4, 3), 0.5)), jnp.full((4, 3), 0.7)
    ev_a, ev_b = (
        losses.evaluate_loss(x, logp, batch, group_size=2, max_new_tokens=3, entropy_BxT=entropy) for x in (a, b)
    )
    assert ev_a.metrics.keys() == ev_b.metrics.keys()
    for k in ev_a.metrics:
        np.testing.assert_array_equal(ev_a.metrics[k], ev_b.metrics[k], err_msg=k)
    # the same checks for both forms
    for options in ({"tis_cp": 2.0}, "tis_cp=2.0"):
        with pytest.raises(ConfigError, match="has no parameter 'tis_cp'; allowed: .*; did you mean 'tis_cap'"):
            losses.make_loss(LossConfig(preset="dapo", options=options))
    with pytest.raises(ConfigError, match=r"loss.options\['kl_estimator'\]: got function"):
        LossConfig(options={"kl_estimator": losses.kl_k1}).validate()


# ----------------------------------------------------------------------------- training


@pytest.mark.slow
def test_user_config_trains_and_evaluates_from_the_cli(capsys, tmp_path, user_config, in_process_cache):
    """docs/extending.md's commands, on the tiny model for 2 steps."""
    workdir = tmp_path / "run"
    code, _, err = _cli(
        capsys, "train", str(user_config), "--workdir", str(workdir), *TINY_ARGS, "--set", "train.steps=2",
        "--set", "loss.preset=gspo_dr", "--set", "loss.eps_high=1e-3", "--set", "loss.options=tis_cap=2.0",
    )  # fmt: skip
    assert code == 0, err
    saved = json.loads((workdir / "config.json").read_text())
    assert saved["loss"]["preset"] == "gspo_dr" and saved["loss"]["options"] == "tis_cap=2.0"
    assert saved["loss"]["eps_high"] == 1e-3
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["step"] in (1, 2) and "loss" in r]
    assert len(trained) == 2 and all(np.isfinite(r["loss"]) for r in trained)
    code, table, err = _cli(capsys, "eval", str(user_config), "--workdir", str(workdir), *TINY_ARGS, "--prompts", "8")
    assert code == 0, err
    report = json.loads((workdir / "eval" / "step_2.json").read_text())
    assert report["step"] == 2 and report["prompts"] == 8 and "pass@1" in report["metrics"]


@pytest.mark.slow
def test_train_takes_a_loss_from_python(tmp_path, in_process_cache):
    from jaxrl.train.loop import train

    cfg = load_config(DEFAULT_CONFIG, [*TINY, "train.steps=2"])
    loss = losses.compose(
        "clip_higher_token_mean",
        reward_combine=losses.reward_sum((1.0, 0.0)),
        normaliser=losses.group_mean_std(),
        ratio=losses.token_log_ratio,
        objective=losses.ppo_clip(0.2, 0.28),
        weights=losses.token_mean,
    )
    with pytest.raises(ConfigError, match="loss.reward_weights: set to .*train\\(\\) was given a Loss"):
        train(cfg, tmp_path / "refused", loss=loss)
    assert not (tmp_path / "refused").exists()
    with pytest.raises(ConfigError, match="train\\(loss=...\\): SimpleNamespace has no 'advantages'"):
        train(cfg, tmp_path / "refused", loss=types.SimpleNamespace(name="x"))
    rows = train(dataclasses.replace(cfg, loss=LossConfig()), tmp_path / "run", loss=loss)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["loss"]["preset"] == "<clip_higher_token_mean>"
