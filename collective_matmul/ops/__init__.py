"""The ops in JAX: the collective matmuls with their custom VJPs (`collective`), the ring kernels
(`ring`), the plain baselines (`baseline`) and the gathers shared by projections of one activation
(`share`)."""
