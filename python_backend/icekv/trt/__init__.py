"""TensorRT glue: the icekv plugins and engine builds. Imports tensorrt only inside the functions
that need it; everything they compute (shapes, grids, kernel specialisations) lives in plain
functions in :mod:`icekv.trt.spec`, testable without TensorRT."""
