"""``torch.distributed.tensor.experimental``'s names on hyperpar: ``local_map``."""

from hyperpar.torch.dtensor.local_map import local_map

__all__ = ["local_map"]
