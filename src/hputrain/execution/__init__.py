"""How the model runs on the device: execution modes (eager, lazy, compile), precision plugins,
fp8 training, the device's fused kernels in Hugging Face models, graph-captured inference."""
