"""The memory plan: what a run holds per device, whether it fits, and the settings that would."""
