"""``--calibrate`` on the CPU: two Gloo processes through the engine's communicator, tiny sizes."""

from __future__ import annotations

import pytest
from plan_configs import data_config

from tpserve.plan import calibrate as calibration
from tpserve.plan.cli import main

# Tiny sizes: only the calibration code path is under test here, not its figures.
QUICK_SIZES = calibration.Sizes(copy_bytes=8 << 20, matmul_n=128, small_bytes=4 << 10, large_bytes=1 << 20, iters=5)


def test_calibration_measures_positive_figures():
    cal = calibration.calibrate("cpu", QUICK_SIZES)
    assert cal.device == "cpu" and cal.link is not None
    for value in (cal.memory_bytes, cal.copy_bandwidth, cal.matmul_flops, cal.link.alpha_s, cal.link.bus_bandwidth):
        assert 0 < value < float("inf")
    spec = cal.as_spec()
    assert spec.device == "cpu" and spec.copy_bandwidth == cal.copy_bandwidth and spec.link == cal.link


def test_cli_calibrate_on_cpu_plans_with_the_measured_figures(monkeypatch, capsys):
    monkeypatch.setattr(calibration, "CPU_SIZES", QUICK_SIZES)
    model = data_config("Qwen2.5-7B-Instruct")
    assert main(["--model", model, "--gpu", "cpu", "--gpus", "2", "--context", "1024", "--calibrate", "--memory-gib", "64"]) == 0
    out = capsys.readouterr().out
    assert "machine: 2 x cpu (calibrated): " in out
    assert "--device cpu --max-total-tokens" in out  # the CPU engine sizes its KV from that flag
    # float32 on the CPU, as the engine runs there
    assert "at 4 bytes each" in out


@pytest.mark.parametrize("device", ["cpu"])
def test_as_spec_keeps_the_table_link_without_a_second_device(device):
    cal = calibration.Calibration(device, "x", 1.0, 2.0, 3.0, link=None)
    assert cal.as_spec().link == calibration.GPUS["cpu"].link
