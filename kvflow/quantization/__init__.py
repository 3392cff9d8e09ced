"""Weight-only quantization: integer weights with per-group float scales (INT8, INT4, GGUF,
compressed-tensors, GPTQ).

- `config.py`: `QuantizationConfig`, the user's options checked;
- `qweight.py`: `QuantizedWeight`, the one record every format becomes;
- `methods.py`: quantizing float weights at load (int8, int4);
- `gguf.py`: GGUF Q8_0/Q4_0/Q4_1 blocks as they are shipped;
- `compressed_tensors.py`: Hugging Face compressed-tensors W4A16/W8A16 checkpoints as shipped;
- `gptq.py`: Hugging Face GPTQ-format checkpoints (qweight/qzeros/scales/g_idx) as shipped;
- `kernels.py`: the linear layer's product (csrc/quant_gemm.cpp, or PyTorch);
- `apply.py`: turning a loaded model's `Linear`s into quantized ones.
"""

from kvflow.quantization.config import QuantizationConfig
from kvflow.quantization.qweight import QuantizedWeight

__all__ = ["QuantizationConfig", "QuantizedWeight"]
