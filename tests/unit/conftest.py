"""Fixtures shared by unit test modules (each defined beside its helpers)."""

from tests.unit.loopback import loopback
from tests.unit.rebalance_rig import rig

__all__ = ["loopback", "rig"]
