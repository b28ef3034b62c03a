"""Evaluation of retrofitted models: quick teacher-forced checks (the bounded-memory engine comes next)."""
