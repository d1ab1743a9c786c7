"""The ops in JAX: the collective matmuls with their custom VJPs (`collective`), the ring kernels
(`ring`) and the gathering ring's schedule (`ring_schedule`, no JAX), the plain baselines
(`baseline`) and the gathers shared by projections of one activation (`share`)."""
