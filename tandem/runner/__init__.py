"""The only package that imports mlx. Importing it preloads an optimized BLAS first."""

from tandem.runner.blas import preload_blas

preload_blas()
