"""GPU (Pallas Triton) mixed-precision decode attention."""
from pallas_kernels.gpu.decode import decode_attention_gpu, partials_gpu

__all__ = ["decode_attention_gpu", "partials_gpu"]
