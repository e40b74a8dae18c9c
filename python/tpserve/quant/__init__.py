"""Weight quantization: FP8 (e4m3) with one scale per block of the weight.

``config.py`` reads a checkpoint's ``quantization_config`` (or ``--quantization fp8`` for an
unquantized checkpoint) into a ``QuantConfig``; ``fp8.py`` holds the numerics in torch (block
quantization, dequantization, the per-token activation quantization and the reference GEMM).
The layers that use them are in ``layers/linear.py``; the GPU GEMM is ``kernels/fp8_gemm.py``.
"""
