"""Imported once by the bounded pool's fork server (`bounded.PRELOAD`): math-verify and sympy are
imported and one answer verified there, so every worker forked from it starts warm."""

try:
    from hapo_megatron.rewards.math import verify_unbounded

    verify_unbounded("\\frac{1}{2}", "0.5")
except Exception:  # noqa: BLE001 - a failed warm-up only costs the workers their first call's time
    pass
