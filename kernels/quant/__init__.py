"""Weight formats kept as stored: the packed layouts the CPU and GPU kernels read
(weight.py), quantizing on load (quantize.py), GGUF blocks repacked (gguf_blocks.py) and the
torch reference that expands any of them to fp32 (dequantize.py)."""
