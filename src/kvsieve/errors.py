"""Errors of policy and budget specifications (shared by `kvsieve.policy` and `kvsieve.budget`)."""


class PolicyError(ValueError):
    """An unknown policy, allocator or parameter, a value outside its range, or a budget that cannot be met."""
