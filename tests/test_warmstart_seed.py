"""`warmstart.seed`: runs that differ only in train.seed can share one base policy (the warm start's
cache key and its training use warmstart.seed when set), and the default (-1 = train.seed) keeps
every cache key made before the field existed."""

import dataclasses

import pytest

from jaxrl.config import Config, ConfigError, TrainConfig, WarmStartConfig
from jaxrl.data.tokenizer import CharTokenizer
from jaxrl.policy.warmstart import cache_key, warmstart_seed

TOK = CharTokenizer()


def _key(train_seed: int, ws_seed: int = -1) -> str:
    cfg = Config(train=TrainConfig(seed=train_seed), warmstart=WarmStartConfig(seed=ws_seed))
    return cache_key(cfg, dataclasses.replace(cfg.model, vocab_size=TOK.vocab_size), TOK.alphabet)


def test_default_key_is_the_one_made_before_the_field_existed():
    # Computed with the previous warmstart.cache_key (no warmstart.seed) on Config(): a cached base
    # policy from an older jaxrl is still found.
    assert _key(0) == "8fbadb211bbaa9d0"


def test_warmstart_seed_shares_one_base_policy_across_train_seeds():
    assert _key(1) != _key(0)
    assert _key(1, ws_seed=0) == _key(0) == _key(2, ws_seed=0)
    assert warmstart_seed(Config(train=TrainConfig(seed=5))) == 5
    assert warmstart_seed(Config(train=TrainConfig(seed=5), warmstart=WarmStartConfig(seed=3))) == 3


def test_bad_warmstart_seed_names_the_field():
    with pytest.raises(ConfigError, match="warmstart.seed"):
        Config(warmstart=WarmStartConfig(seed=-2)).validate()
