"""Why a training run stopped: errors the trainer raises after it has started (a bad recipe is a RecipeError)."""


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; names the step and the loss terms."""
