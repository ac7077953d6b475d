"""GPU (Pallas Triton) mixed-precision decode attention and the Spherical KV tier partitions."""
from pallas_kernels.gpu.decode import decode_attention_gpu, partials_gpu
from pallas_kernels.gpu.spherical import decode_attention_sph_gpu, sph_partials_gpu

__all__ = ["decode_attention_gpu", "decode_attention_sph_gpu", "partials_gpu", "sph_partials_gpu"]
