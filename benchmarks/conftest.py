from ditron_ops import _env

_env.prepare_cuda_for_virtual_ranks()  # before any CUDA call (see its docstring)
