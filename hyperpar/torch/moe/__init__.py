"""The torch mechanics of Mixture-of-Experts: the user layer (:mod:`.router`, :mod:`.experts`,
:mod:`.layer`), DeepSpeed's layer (:mod:`.deepspeed`) and the expert-parallel styles. Users
import them from :mod:`hyperpar.moe`."""
