"""The live training dashboard renders every figure it promises."""

from __future__ import annotations

from rich.console import Console

from ranvier.dashboard import Dashboard, sparkline
from ranvier.profile import Profile, StepTime
from ranvier.progress import expected_steps, training_progress


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
    assert lines == ["step 2/10 loss 1.5000 1.0 steps/s eta 8s tokens/s 100.0",
                     "step 4/10 loss 1.5000 1.0 steps/s eta 6s tokens/s 100.0"]
