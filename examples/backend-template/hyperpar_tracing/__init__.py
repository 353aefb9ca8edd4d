"""An out-of-tree hyperpar backend in one file: CPU tensors, gloo collectives, and a count of
every collective call per op (``TracingPlatform.calls``) -- handy to see what a parallel
layer communicates. Select it with ``HYPERPAR_BACKEND=tracing``."""

from __future__ import annotations

from collections import Counter

from hyperpar.platform import Availability, hookimpl
from hyperpar.platform.torch_platform import HostDevicePlatform


class TracingPlatform(HostDevicePlatform):  # host tensors: device members inherited
    name = "tracing"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = -10  # never auto-selected over a real device backend
    native_reduce_ops = ("sum", "max", "min", "product")  # gloo has no AVG

    calls: Counter = Counter()

    @classmethod
    def is_available(cls) -> Availability:
        return Availability(True)

    # collectives: count, then defer to the shared torch implementation
    def all_reduce(self, tensor, op="sum", group=None, async_op=False):
        self.calls["all_reduce"] += 1
        return super().all_reduce(tensor, op, group, async_op)

    def all_gather_into_tensor(self, output, input, group=None, async_op=False):
        self.calls["all_gather_into_tensor"] += 1
        return super().all_gather_into_tensor(output, input, group, async_op)

    def reduce_scatter_tensor(self, output, input, op="sum", group=None, async_op=False):
        self.calls["reduce_scatter_tensor"] += 1
        return super().reduce_scatter_tensor(output, input, op, group, async_op)


@hookimpl
def hyperpar_backends():
    return [TracingPlatform]
