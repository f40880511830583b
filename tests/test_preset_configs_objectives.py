"""Each config of the presets that differ in ratio level and objective trains 2 steps in-process (see
preset_configs.py)."""

import pytest
from preset_configs import FILES, check_config_trains_two_steps

pytestmark = pytest.mark.usefixtures("persistent_compile_cache")  # training runs repeat programs


@pytest.mark.slow
@pytest.mark.parametrize("preset", FILES["objectives"])
def test_config_trains_two_steps(preset, tmp_path, in_process_cache):
    check_config_trains_two_steps(preset, tmp_path / preset)
