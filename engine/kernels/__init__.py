"""Native kernels for GGUF weights: `cpu` builds and loads the C dequantize/matmul kernels for the CPU;
`triton_blocks` holds the Triton kernels for CUDA (`gpu` says whether they can run, without Triton)."""
