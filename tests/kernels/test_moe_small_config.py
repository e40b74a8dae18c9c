"""``TPSERVE_MOE_SMALL``: the small-batch MoE kernels' settings for experiments, on top of the defaults."""

import pytest

pytest.importorskip("triton")


def test_setting_changes_one_kernel_field():
    from tpserve.kernels.moe_small import config_from_setting, default_config

    base = default_config(8)
    assert config_from_setting(8) == base
    changed = config_from_setting(8, "down_block_n=4 gate_up_num_stages=3,down_prefetch=0")
    assert changed.down.block_n == 4 and changed.down.prefetch is False and changed.gate_up.num_stages == 3
    assert (changed.down.block_k, changed.gate_up.block_n) == (base.down.block_k, base.gate_up.block_n)


@pytest.mark.parametrize("bad", ["down_blk=4", "block_n=4", "router_block_n=4", "down_block_n=3", "down_block_k"])
def test_bad_settings_are_named(bad):
    from tpserve.kernels.moe_small import CONFIG_ENV, config_from_setting

    with pytest.raises(ValueError, match=CONFIG_ENV + "|power of 2"):
        config_from_setting(8, bad)
