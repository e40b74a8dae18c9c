"""Weight quantization: FP8 (e4m3) with one scale per weight block; ``config.py`` reads it,
``fp8.py`` holds the torch numerics (the layers are ``layers/linear.py``, the GPU GEMMs ``kernels/``)."""
