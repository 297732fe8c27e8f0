"""The only package that imports mlx. Importing it preloads an optimized BLAS first and
keeps glibc from trimming the heap MLX's CPU stream allocates from (runner/malloc.py)."""

from tandem.runner.blas import preload_blas
from tandem.runner.malloc import tune_malloc

preload_blas()
tune_malloc()
