"""TPU (Pallas Mosaic) mixed-precision decode attention."""
from pallas_kernels.tpu.decode import decode_attention_tpu, partials_tpu

__all__ = ["decode_attention_tpu", "partials_tpu"]
