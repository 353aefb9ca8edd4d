"""torch mechanics of tensor parallelism: the style classes on ``nn.Module`` (``style``,
``prepare``), their differentiable boundary collectives (``_comm``), ``loss_parallel`` and the
Megatron-style layers. Imported through :mod:`hyperpar.parallel`."""

# The public package first, for the same reason as in hyperpar.torch.dtensor.
import hyperpar.parallel  # noqa: E402,F401
