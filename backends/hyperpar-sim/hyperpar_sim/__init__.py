"""hyperpar simulation backend: one process plays any rank of any world size; collectives
produce right-shaped results without communicating and record what they would have moved."""

from .platform import CollectiveRecord, SimGroup, SimPlatform, simulate

__all__ = ["CollectiveRecord", "SimGroup", "SimPlatform", "simulate"]
