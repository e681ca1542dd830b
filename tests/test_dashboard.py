"""The live training dashboard renders every figure it promises."""

from __future__ import annotations

import io
import re

from rich.console import Console
from rich.live import Live

from ranvier import dashboard
from ranvier.dashboard import Dashboard, sparkline
from ranvier.jobs.peak import measured_peak
from ranvier.profile import Profile, StepTime
from ranvier.progress import BAR_WIDTH, expected_steps, fit, training_progress


def test_sparkline_scales_to_the_block_range():
    assert sparkline([]) == ""
    line = sparkline([5.0, 4.0, 3.0, 2.0, 1.0])
    assert line[0] == "█" and line[-1] == "▁" and len(line) == 5
    assert len(sparkline(list(range(1000)), width=40)) == 40


def test_dashboard_shows_speed_efficiency_kernels_memory_and_samples():
    board = Dashboard("run", total_steps=100, compile_seconds=1.5, peak_gflops=200.0)
    for step, loss in enumerate([3.0, 2.5, 2.7], 1):
        board.update(step, loss, seconds=0.05, tokens=1000, flops=5e9)
    board.validation = 2.6
    board.set_profile(Profile("train", 3, [StepTime(0, "BlasGemm[avx512]", 0.03, 0, None), StepTime(1, "AttentionRow[avx512]", 0.01, 0, None)]))
    board.sample = "Once upon a time"
    console = Console(record=True, width=100, force_terminal=True)
    console.print(board.render())
    text = console.export_text()
    for expected in ("step", "3/100", "2.7000", "best 2.5000", "2.6000", "ms/step", "50.0", "20,000", "100.0",
                     "50% of 200: measured fp32 GEMM", "1.5 s", "MB peak resident", "BlasGemm[avx512]", "75.0%", "Once upon a time"):
        assert expected in text, expected


def test_dashboard_names_a_time_limit():
    board = Dashboard("run", total_steps=100, compile_seconds=1.0, peak_gflops=100.0, time_limit=300.0)
    board.update(1, 3.0, seconds=0.05, tokens=1000, flops=5e9)
    console = Console(record=True, width=100, force_terminal=True)
    console.print(board.render())
    assert "1/100  (stops after 5 min)" in console.export_text()


def test_progress_under_a_time_limit_counts_the_steps_that_fit():
    assert expected_steps(2000, 0, 0.0, 300.0) == 2000  # no rate yet
    assert expected_steps(2000, 100, 20.0, None) == 2000
    assert expected_steps(2000, 100, 20.0, 300.0) == 1500  # 5 steps/s for 300 s
    assert expected_steps(1000, 100, 20.0, 300.0) == 1000  # the step count ends it first
    assert expected_steps(2000, 100, 400.0, 300.0) == 100  # past the limit


def test_plain_progress_lines_show_the_expected_total_and_eta(capsys, monkeypatch):
    clock = iter(2.0 * t for t in range(100))  # read at the start and at each printed line
    monkeypatch.setattr("ranvier.progress.time.perf_counter", lambda: next(clock))
    with training_progress(1000, every=2, seconds=10.0) as report:
        for _ in range(4):
            report(1.5, **{"tokens/s": 100.0})
    lines = capsys.readouterr().err.splitlines()
    # One second per step: after 2 steps (2 s) 8 more fit in the 10 s; after 4, 6 more.
    assert lines[1:] == ["step 2/10 loss 1.5000 1.0 steps/s eta 8s tokens/s 100.0",
                         "step 4/10 loss 1.5000 1.0 steps/s eta 6s tokens/s 100.0"]
    assert "means over the steps since the line before" in lines[0]


def test_plain_progress_lines_average_every_figure_since_the_line_before(capsys, monkeypatch):
    clock = iter([0.0, 2.0, 10.0])  # 2 steps in 2 s, then 2 steps in 8 s
    monkeypatch.setattr("ranvier.progress.time.perf_counter", lambda: next(clock))
    with training_progress(4, every=2) as report:
        for loss, ms in [(4.0, 900.0), (2.0, 1100.0), (1.0, 3000.0), (3.0, 5000.0)]:
            report(loss, **{"ms/step": ms})
    assert capsys.readouterr().err.splitlines()[1:] == [
        "step 2/4 loss 3.0000 1.0 steps/s eta 2s ms/step 1,000.0",
        "step 4/4 loss 2.0000 0.2 steps/s eta 0s ms/step 4,000.0"]


def _progress_line(width: int, total: int = 2340) -> str:
    console = Console(file=io.StringIO(), width=width, force_terminal=True, color_system="standard")
    with training_progress(total, console=console) as report:
        for _ in range(3):
            report(0.0123, **{"examples/s": 121443.6, "ms/step": 1.1, "GFLOP/s": 148.2})
    frames = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", console.file.getvalue()).replace("\r", "\n").splitlines()
    return [frame for frame in frames if "3/" in frame][-1].rstrip()


def test_progress_bar_fits_the_terminal_dropping_the_least_important_columns():
    narrow, medium, wide = _progress_line(80), _progress_line(100), _progress_line(160)
    for line, width in [(narrow, 80), (medium, 100), (wide, 160)]:
        assert len(line) <= width, line
        assert line.startswith("━" * BAR_WIDTH) and "3/2340" in line and re.search(r"eta \d+:\d\d:\d\d", line), line
    assert "loss 0.0123" in narrow and "steps/s" in narrow and "GFLOP/s" not in narrow
    assert "examples/s 121,443.6" in medium and "GFLOP/s" not in medium
    assert "GFLOP/s 148.2" in wide and "elapsed 0:00:00" in wide
    assert fit(["aaa", "bbb", "ccc"], 8) == "aaa  bbb" and fit(["aaaaaaaaa"], 8) == ""


def test_dashboard_last_frame_shows_the_final_validation_loss(monkeypatch):
    console = Console(file=io.StringIO(), width=80, force_terminal=True, color_system=None)
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    monkeypatch.setattr(dashboard, "measured_peak_gflops", lambda: 100.0)
    monkeypatch.setattr(Dashboard, "live", lambda board: Live(board.render(), console=console, auto_refresh=False))
    with dashboard.training_display(2, progress=True, dashboard=True, title="run", compile_seconds=1.0, flops_per_step=1e9,
                                    items_per_step=10, unit="tokens", profile=lambda: Profile("train", 1, [])) as show:
        show(1, 3.0, 0.01, {"val_loss": 2.9})
        show(2, 2.5, 0.01, {})
        show.final({"val_loss": 2.4321})
    last = console.file.getvalue().rpartition("╭")[2]
    assert "validation  2.4321" in last


def test_on_a_gpu_the_share_of_peak_is_the_devices_own_product_in_the_runs_precision(monkeypatch):
    """A CUDA run's dashboard measures the device's product (the cuBLASLt call its steps
    make, bf16 here) by the device's clock: its share is the run's MFU. Here on the host
    emulator, at its small size."""
    monkeypatch.setenv("RANVIER_CUDA_DEVICE", "emulator")
    gflops, what = measured_peak("cuda", "bfloat16")
    assert gflops > 0 and what == "bfloat16 GEMM on cuda"
    board = Dashboard("run", total_steps=10, compile_seconds=1.0, peak_gflops=gflops, peak_what=what)
    board.update(1, 2.0, 1.0, 100, gflops * 0.5e9)
    console = Console(file=io.StringIO(), width=120, color_system=None)
    console.print(board.render())
    assert f"50% of {gflops:,.0f}: measured bfloat16 GEMM on cuda" in console.file.getvalue()

