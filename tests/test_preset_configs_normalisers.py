"""Each config of the presets that differ in advantage estimator and normaliser trains 2 steps in-
process (see preset_configs.py)."""

import pytest
from conftest import REPO
from preset_configs import FILES, check_config_trains_two_steps

from jaxrl.losses import PRESETS

pytestmark = pytest.mark.usefixtures("persistent_compile_cache")  # training runs repeat programs


@pytest.mark.slow
@pytest.mark.parametrize("preset", FILES["normalisers"])
def test_config_trains_two_steps(preset, tmp_path, in_process_cache):
    check_config_trains_two_steps(preset, tmp_path / preset)


def test_every_preset_has_a_config_file_and_a_training_test():
    assert sorted(sum(FILES.values(), [])) == sorted(PRESETS)
    assert {p.name for p in (REPO / "configs").glob("*_arithmetic.py")} == {f"{n}_arithmetic.py" for n in PRESETS}
