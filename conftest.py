"""Before any test or doctest touches CUDA: the variables virtual ranks need (see
``ditron_ops._env.prepare_cuda_for_virtual_ranks``)."""
from ditron_ops import _env

_env.prepare_cuda_for_virtual_ranks()
