"""Runtime: launch, guard, measure and record one run on every rank."""
