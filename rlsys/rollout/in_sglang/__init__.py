"""Code that runs inside SGLang's server processes (imported there by name, through SGLang's own hooks), not in
rlsys's. It may import only torch, numpy and what of rlsys needs no more: SGLang's environment has nothing else."""
