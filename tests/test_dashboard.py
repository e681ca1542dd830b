"""The live training dashboard renders every figure it promises."""

from __future__ import annotations

from rich.console import Console

from ranvier.dashboard import Dashboard, sparkline
from ranvier.profile import Profile, StepTime


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
                     "50% of 200 measured peak", "1.5 s", "MB peak resident", "BlasGemm[avx512]", "75.0%", "Once upon a time"):
        assert expected in text, expected
