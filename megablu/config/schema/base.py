"""What every config section shares: unknown keys are errors, inf and nan are never a setting."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    # inf and nan are never a setting (lr: .inf trained to a NaN loss after the ranks started)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


# Seeds feed numpy's and torch's generators, whose seeds are unsigned (numpy's legacy API: 32 bits).
SEED_MAX = 2**32 - 1


# More optimizer steps than any run megablu is for; a bigger value is a typo (1e30).
MAX_STEPS_MAX = 10**9
