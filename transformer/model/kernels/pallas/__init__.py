"""Flash attention as Pallas kernels, the positional bias computed inside them: the
custom-VJP function (attention.py), the blocks each kernel visits (sparsity.py), a bias as a
table over k − q (tables.py), the kernel bodies (bodies.py) and each lowering's layout of
arrays and blocks (layouts.py), and Mosaic GPU (Hopper) kernels: the warp-specialised
forward (mosaic_gpu.py), the backward and the differentiable attention of kernel
`mosaic_gpu` (mosaic_gpu_backward.py), the block pieces they share (mosaic_blocks.py) and
the positional bias inside them (mosaic_bias.py)."""

from transformer.model.kernels.pallas.attention import flash_attention
from transformer.model.kernels.pallas.mosaic_gpu import forward as mosaic_gpu_forward
from transformer.model.kernels.pallas.mosaic_gpu_backward import attention as mosaic_gpu_attention

__all__ = ["flash_attention", "mosaic_gpu_attention", "mosaic_gpu_forward"]
