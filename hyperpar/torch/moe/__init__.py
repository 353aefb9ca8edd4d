"""PyTorch mechanics of Mixture-of-Experts: token dispatch and combine over the ``ep`` mesh
(:mod:`.dispatch`), the expert-parallel styles (:mod:`.styles`), the user layer
(:mod:`.router`, :mod:`.experts`, :mod:`.layer`) and DeepSpeed's layer (:mod:`.deepspeed`).
The decisions (splits, segment orders, placements, drop order) come from the neutral core
:mod:`hyperpar.moe`; users import the layers from :mod:`hyperpar.moe`."""
