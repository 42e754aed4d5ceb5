"""Asynchronous schedules: PipeDream (weight stashing) and PipeDream-2BW."""
