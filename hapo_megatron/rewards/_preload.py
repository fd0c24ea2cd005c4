"""Imported by a math-reward worker when it starts (`bounded.MATH_PRELOAD`): math-verify and sympy
are imported and one answer verified, so the first real call does not pay for it (nor count it
against its time limit)."""

try:
    from hapo_megatron.rewards.math import verify_unbounded

    verify_unbounded("\\frac{1}{2}", "0.5")
except Exception:  # noqa: BLE001 - a failed warm-up only costs the workers their first call's time
    pass
