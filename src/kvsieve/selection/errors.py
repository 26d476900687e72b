"""Errors shared by several modules: policy and budget specifications, models sieve attention cannot serve."""


class PolicyError(ValueError):
    """An unknown policy, allocator or parameter, a value outside its range, or a budget that cannot be met."""


class UnhookableModelError(ValueError):
    """The model's attention cannot be routed through sieve attention."""
