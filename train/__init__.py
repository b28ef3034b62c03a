"""The retrofit trainer: recipes, the Lightning module, losses, schedules, strategies."""
