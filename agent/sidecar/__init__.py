"""``sdcguard sidecar``: publishes spooled alarm records as Kubernetes Events, serves metrics.

Torch-free (its image has no torch): it imports only ``sdcguard.contract`` besides its own modules.
"""
from .publisher import main

__all__ = ["main"]
