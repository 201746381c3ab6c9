"""Model files in and out: Hugging Face safetensors checkpoints (`loader`), llama.cpp GGUF files
(`gguf`), the layout and config.json both readers share (`hf_layout`), PEFT LoRA adapters
(`peft_adapter`) and the tiny offline test model (`tiny`).

Import the modules themselves (`from qerl_jax.model_io import loader`); this package's own
namespace stays empty so that importing one of them does not load the others.
"""
