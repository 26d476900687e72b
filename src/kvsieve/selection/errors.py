"""The error of policy and budget specifications, shared by the selection modules."""


class PolicyError(ValueError):
    """An unknown policy, allocator or parameter, a value outside its range, or a budget that cannot be met."""
