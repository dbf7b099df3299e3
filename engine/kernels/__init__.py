"""Native kernels for GGUF weights: `cpu` builds and loads the C dequantize/matmul kernels for the CPU."""
