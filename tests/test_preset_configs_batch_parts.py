"""Each config of the presets with batch-level prepare parts, multi-reward estimators or special group
sizes trains 2 steps in-process (see preset_configs.py)."""

import pytest
from preset_configs import FILES, check_config_trains_two_steps

pytestmark = pytest.mark.usefixtures("persistent_compile_cache")  # training runs repeat programs


@pytest.mark.slow
@pytest.mark.parametrize("preset", FILES["batch_parts"])
def test_config_trains_two_steps(preset, tmp_path, in_process_cache):
    check_config_trains_two_steps(preset, tmp_path / preset)
