"""Zero-bubble schedules: ZB-H1, ZB-H2, ZB-V and DualPipeV (backward split into B and W)."""
