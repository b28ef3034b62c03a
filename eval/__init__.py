"""Judging retrofitted models: the bounded-memory engine (`eval.engine`), evaluation suites run through it
at matched memory (`python -m eval SUITE`, a sweep of methods x budgets x tasks), reports, an lm-eval model,
and a quick teacher-forced check of a snapshot on its run's held-out split (`python -m eval quick`)."""
