"""What a run tells its user.

    progress.py       progress lines or a bar as it trains, evaluations, the summary
    metrics_file.py   the --metrics file: JSON lines appended whole, or not at all
    divergence.py     a loss that stays far above where it started; which option made a NaN
    step_breakdown.py where a step's time goes: forward, backward, update, communication, waiting

Exercised by: python -m pytest tests/test_report.py tests/test_metrics_file.py tests/test_divergence.py
"""
