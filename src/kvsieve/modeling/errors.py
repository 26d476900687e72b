"""The error a model kvsieve cannot serve raises."""


class UnhookableModelError(ValueError):
    """The model's attention cannot be routed through sieve attention."""
