"""PyTorch mechanics of Mixture-of-Experts: token dispatch and combine over the ``ep`` mesh
(:mod:`.dispatch`) and the expert-parallel styles (:mod:`.styles`). The decisions (splits,
segment orders, placements, drop order) come from the neutral core :mod:`hyperpar.moe`."""
