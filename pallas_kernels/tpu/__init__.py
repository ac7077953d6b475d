"""TPU (Pallas Mosaic) mixed-precision decode attention and the Spherical KV tier partitions."""
from pallas_kernels.tpu.decode import decode_attention_tpu, partials_tpu
from pallas_kernels.tpu.spherical import decode_attention_sph_tpu, sph_partials_tpu

__all__ = ["decode_attention_sph_tpu", "decode_attention_tpu", "partials_tpu", "sph_partials_tpu"]
